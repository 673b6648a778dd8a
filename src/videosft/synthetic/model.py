"""The tiny Qwen3.5 checkpoint: a random-init ``Qwen3_5ForConditionalGeneration`` (model_type
``qwen3_5``) with the tokenizer trained here, a ChatML template and the Qwen3-VL processor, saved as
a sharded safetensors checkpoint with an index, like a published one; pretrained first to see the
ball when ``demo.pretrain.steps`` asks (:mod:`videosft.synthetic.pretraining`)."""

from __future__ import annotations

from pathlib import Path

from ..config import View
from .pretraining import pretrain
from .tokenizer import CHAT_TEMPLATE, build_tokenizer

PATCH = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
HEADS = 4
# The head shares the embedding's weights (no lm_head.weight in the files), as the small published
# Qwen3.5 models do. Said at the top level, which transformers ties by, and in the text config, which
# vLLM reads: a text config saying false would have it look for an lm_head.weight that is not there.
TIED = True


def build_processor(vocab_size: int):
    """The Qwen3-VL processor around a tokenizer trained here, with the demo's chat template."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**PATCH),
        tokenizer=build_tokenizer(vocab_size),
        video_processor=Qwen3VLVideoProcessor(**PATCH, cap_pixels_per_frame=False),
        chat_template=CHAT_TEMPLATE,
    )


def text_config(model_cfg: View, tokenizer) -> dict:
    """The language model: Qwen3.5's mix of Gated-DeltaNet and attention layers, at ``demo.model``'s size."""
    token_id = tokenizer.convert_tokens_to_ids
    hidden = model_cfg.hidden_size
    head_dim = max(32, hidden // HEADS)  # 32 leaves room for all three M-RoPE sections
    rotary_half = int(head_dim * 0.25) // 2
    mrope = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=model_cfg.layers,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=head_dim,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=8192,
        eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
        tie_word_embeddings=TIED,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
    )


def model_config(model_cfg: View, tokenizer):
    """The whole model's config: the language model, a vision tower of the processor's patch geometry,
    and the tokenizer's ids of the vision tokens."""
    from transformers import Qwen3_5Config

    token_id = tokenizer.convert_tokens_to_ids
    vision = dict(
        depth=model_cfg.vision_depth,
        hidden_size=model_cfg.vision_hidden_size,
        intermediate_size=2 * model_cfg.vision_hidden_size,
        num_heads=2,
        out_hidden_size=model_cfg.hidden_size,
        num_position_embeddings=64,
        **{k: v for k, v in PATCH.items() if k != "merge_size"},
        spatial_merge_size=PATCH["merge_size"],
    )
    return Qwen3_5Config(
        text_config=text_config(model_cfg, tokenizer),
        vision_config=vision,
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=TIED,
    )


def build_model_dir(cfg: View, out: Path, system: str = "") -> dict:
    """The checkpoint in ``out`` (``cfg``: the demo section; ``system``: the pretraining's system line),
    and what it holds."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    processor = build_processor(cfg.model.vocab_size)
    tokenizer = processor.tokenizer
    config = model_config(cfg.model, tokenizer)
    torch.manual_seed(cfg.seed)
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    pretraining = pretrain(model, processor, cfg, system) if cfg.pretrain.steps else None
    model.save_pretrained(out, max_shard_size=cfg.model.shard_size)
    processor.save_pretrained(out)
    return {
        "pretraining": pretraining,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layer_types": config.text_config.layer_types,
        "vocab_size": len(tokenizer),
        "shards": len(list(out.glob("model-*.safetensors"))),
    }

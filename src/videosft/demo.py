"""The embedded default: synthetic videos with known answers, and a tiny Qwen3.5 checkpoint.

Each video shows a moving background and a red ball that is visible during one or two
intervals; the ball's visible intervals are the video's keep ranges. The model is a
random-init ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``) with a byte-level
BPE tokenizer trained here, the Qwen special tokens, a ChatML template and the Qwen3-VL
processor, saved as a sharded safetensors checkpoint with an index, like a published one.

    python -m videosft.demo --config config.yaml --out data/demo
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import config as config_lib
from .provenance import exit_after, run_record, stage_parser, write_json

QUERY = "the red ball"
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# ChatML as the Qwen models write it; a video part becomes the vision placeholder that the
# processor expands into per-frame timestamps and video tokens.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def visible_intervals(rng: np.random.Generator, n_frames: int, fps: int) -> list[tuple[int, int]]:
    """One or two frame intervals [a, b) in which the ball is visible, on whole seconds.

    Whole seconds keep the answers on the same grid as the sampled frame pairs (at the default
    2 fps, one pair per second), so a keep range is decidable from what the model sees.
    """
    seconds = n_frames // fps
    count = int(rng.integers(1, 3))
    bounds = np.sort(rng.choice(np.arange(1, seconds), size=2 * count, replace=False)) * fps
    return [(int(bounds[2 * i]), int(bounds[2 * i + 1])) for i in range(count)]


def render_frames(rng: np.random.Generator, cfg: dict, intervals: list[tuple[int, int]]) -> np.ndarray:
    height, width, fps = cfg["height"], cfg["width"], cfg["fps"]
    n_frames = int(round(cfg["seconds"] * fps))
    yy, xx = np.mgrid[0:height, 0:width]
    base_color = rng.uniform(40, 110, size=3) * np.array([0.6, 1.0, 1.0])  # never red: the ball is
    frames = np.empty((n_frames, height, width, 3), dtype=np.uint8)
    radius = max(3, height // 4)
    for index in range(n_frames):
        phase = 2 * np.pi * index / n_frames
        shade = 30 * np.sin(xx / width * 2 * np.pi + phase)[..., None]
        frame = np.clip(base_color + shade + rng.normal(0, 4, size=(height, width, 3)), 0, 255)
        if any(a <= index < b for a, b in intervals):
            cx = radius + (width - 2 * radius) * (0.5 + 0.45 * np.sin(phase * 3))
            cy = height / 2 + (height / 4) * np.cos(phase * 2)
            disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
            frame[disc] = (230, 30, 30)
        frames[index] = frame.astype(np.uint8)
    return frames


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_videos(cfg: dict, video_dir: Path, annotations: Path) -> list[dict]:
    rng = np.random.default_rng(cfg["seed"])
    rows = []
    n_frames = int(round(cfg["seconds"] * cfg["fps"]))
    for index in range(cfg["videos"]):
        intervals = visible_intervals(rng, n_frames, cfg["fps"])
        name = f"video_{index:03d}.mp4"
        write_mp4(video_dir / name, render_frames(rng, cfg, intervals), cfg["fps"])
        keep = [[a / cfg["fps"], b / cfg["fps"]] for a, b in intervals]
        rows.append({"video": name, "query": QUERY, "keep": keep})
    annotations.parent.mkdir(parents=True, exist_ok=True)
    annotations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def tokenizer_corpus() -> list[str]:
    words = (
        "you are a video editor's assistant watch clip answer which time ranges to keep show "
        "seconds from the start like or none red ball highlight system user assistant"
    )
    numbers = [f"{a}.{b}-{c}.{d}" for a in range(20) for b in range(10) for c, d in [(a + 1, (b + 5) % 10)]]
    return [words, " ".join(numbers), ", ".join(numbers[::7])] * 4


def build_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(), trainer)
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = Qwen3_5Tokenizer(
        vocab=bpe.get_vocab(),
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def build_model_dir(cfg: dict, out: Path) -> dict:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    model_cfg = cfg["model"]
    tokenizer = build_tokenizer(model_cfg["vocab_size"])
    token_id = tokenizer.convert_tokens_to_ids
    patch = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**patch),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**patch, cap_pixels_per_frame=False),
        chat_template=CHAT_TEMPLATE,
    )
    hidden = model_cfg["hidden_size"]
    heads = 4
    head_dim = max(32, hidden // heads)  # 32 leaves room for all three M-RoPE sections
    rotary_half = int(head_dim * 0.25) // 2
    mrope = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    config = Qwen3_5Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=model_cfg["layers"],
            num_attention_heads=heads,
            num_key_value_heads=2,
            head_dim=head_dim,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            max_position_embeddings=8192,
            eos_token_id=token_id("<|im_end|>"),
            pad_token_id=token_id("<|endoftext|>"),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": mrope,
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=model_cfg["vision_depth"],
            hidden_size=model_cfg["vision_hidden_size"],
            intermediate_size=2 * model_cfg["vision_hidden_size"],
            num_heads=2,
            out_hidden_size=hidden,
            num_position_embeddings=64,
            **{k: v for k, v in patch.items() if k != "merge_size"},
            spatial_merge_size=patch["merge_size"],
        ),
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(cfg["seed"])
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = token_id("<|im_end|>")
    model.generation_config.pad_token_id = token_id("<|endoftext|>")
    model.save_pretrained(out, max_shard_size=model_cfg["shard_size"])
    processor.save_pretrained(out)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "layer_types": config.text_config.layer_types,
        "vocab_size": len(tokenizer),
        "shards": len(list(out.glob("model-*.safetensors"))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "demo")
    with run_record("demo", args.out, cfg, args) as record:
        rows = make_videos(cfg["demo"], args.out / "videos", args.out / "annotations.jsonl")
        model_facts = build_model_dir(cfg["demo"], args.out / "model")
        record["results"] = {"videos": len(rows), "model": model_facts}
        write_json(args.out / "demo.json", record["results"])
    print(f"demo: {len(rows)} videos, model with {model_facts['parameters']} parameters in {args.out}")
    return 0


if __name__ == "__main__":
    exit_after(main)

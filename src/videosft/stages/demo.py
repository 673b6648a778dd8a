"""The embedded default: synthetic videos with known answers, and a tiny Qwen3.5 checkpoint.

Each video shows a moving background and a red ball that is visible during one or two
intervals; the ball's visible intervals are the video's keep ranges. The model is a
random-init ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``) with a byte-level
BPE tokenizer trained here, the Qwen special tokens, a ChatML template and the Qwen3-VL
processor, saved as a sharded safetensors checkpoint with an index, like a published one.

    python -m videosft.stages.demo --config config.yaml --out data/demo
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import config as config_lib
from ..provenance import exit_after, run_record, stage_parser, write_json
from ..config import View

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


def render_frames(rng: np.random.Generator, cfg: View, intervals: list[tuple[int, int]],
                  n_frames: int | None = None, indices: list[int] | None = None) -> np.ndarray:
    """Frames ``indices`` (default: all) of a video of ``n_frames`` (default: the demo's length)."""
    height, width = cfg.height, cfg.width
    n_frames = n_frames or int(round(cfg.seconds * cfg.fps))
    indices = range(n_frames) if indices is None else indices
    yy, xx = np.mgrid[0:height, 0:width]
    base_color = rng.uniform(40, 110, size=3) * np.array([0.6, 1.0, 1.0])  # never red: the ball is
    frames = np.empty((len(indices), height, width, 3), dtype=np.uint8)
    radius = max(3, height // 4)
    for slot, index in enumerate(indices):
        phase = 2 * np.pi * index / n_frames
        shade = 30 * np.sin(xx / width * 2 * np.pi + phase)[..., None]
        frame = np.clip(base_color + shade + rng.normal(0, 4, size=(height, width, 3)), 0, 255)
        if any(a <= index < b for a, b in intervals):
            cx = radius + (width - 2 * radius) * (0.5 + 0.45 * np.sin(phase * 3))
            cy = height / 2 + (height / 4) * np.cos(phase * 2)
            disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
            frame[disc] = (230, 30, 30)
        frames[slot] = frame.astype(np.uint8)
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


def make_videos(cfg: View, video_dir: Path, annotations: Path) -> list[dict]:
    rng = np.random.default_rng(cfg.seed)
    rows = []
    n_frames = int(round(cfg.seconds * cfg.fps))
    for index in range(cfg.videos):
        intervals = visible_intervals(rng, n_frames, cfg.fps)
        name = f"video_{index:03d}.mp4"
        write_mp4(video_dir / name, render_frames(rng, cfg, intervals), cfg.fps)
        keep = [[a / cfg.fps, b / cfg.fps] for a, b in intervals]
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


def build_model_dir(cfg: View, out: Path, system: str = "") -> dict:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    model_cfg = cfg.model
    tokenizer = build_tokenizer(model_cfg.vocab_size)
    token_id = tokenizer.convert_tokens_to_ids
    patch = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**patch),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**patch, cap_pixels_per_frame=False),
        chat_template=CHAT_TEMPLATE,
    )
    hidden = model_cfg.hidden_size
    heads = 4
    head_dim = max(32, hidden // heads)  # 32 leaves room for all three M-RoPE sections
    rotary_half = int(head_dim * 0.25) // 2
    mrope = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    config = Qwen3_5Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=model_cfg.layers,
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
            depth=model_cfg.vision_depth,
            hidden_size=model_cfg.vision_hidden_size,
            intermediate_size=2 * model_cfg.vision_hidden_size,
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
    torch.manual_seed(cfg.seed)
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = token_id("<|im_end|>")
    model.generation_config.pad_token_id = token_id("<|endoftext|>")
    pretraining = pretrain(model, processor, cfg, system) if cfg.pretrain.steps else None
    model.save_pretrained(out, max_shard_size=model_cfg.shard_size)
    processor.save_pretrained(out)
    return {
        "pretraining": pretraining,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layer_types": config.text_config.layer_types,
        "vocab_size": len(tokenizer),
        "shards": len(list(out.glob("model-*.safetensors"))),
    }


# ---------------------------------------------------------------- pretraining the tiny base

# A random-init model knows nothing a LoRA could adapt, as a pretrained VLM does. The pretraining
# teaches it to see the ball and to read the clip's time markers, with an answer that the range
# format does not parse (a list of marker times, or "never"), so the base still scores zero on the
# pipeline's task: turning those times into keep ranges is left to the fine-tune.
PRETRAIN_INSTRUCTION = "At which of its marked times does this clip show {query}? List them, or say never."
NEVER = "never"


def pretraining_sample(rng: np.random.Generator, cfg: View, processor, system: str) -> dict:
    """A rendered clip, its prompt, and the answer: the time markers of the frame pairs with the ball."""
    import torch
    from transformers.video_utils import VideoMetadata

    from ..encoding.chat import assistant_labels, prompt_timestamps

    pretrain, fps = cfg.pretrain, cfg.fps
    seconds = int(pretrain.clip_seconds)
    n_frames = seconds * fps
    count = int(rng.choice(3, p=[0.15, 0.45, 0.4]))  # windows with 0, 1 or 2 keep ranges
    bounds = np.sort(rng.choice(np.arange(seconds + 1), size=2 * count, replace=False)) * fps
    intervals = [(int(bounds[2 * i]), int(bounds[2 * i + 1])) for i in range(count)]
    picks = np.linspace(0, n_frames - 1, int(seconds * pretrain.sample_fps) // 2 * 2).round().astype(int)
    frames = torch.from_numpy(render_frames(rng, cfg, intervals, n_frames, picks.tolist())).permute(0, 3, 1, 2)
    turns = [{"role": "system", "content": system},
             {"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": PRETRAIN_INSTRUCTION.format(query=QUERY)}]}]
    metadata = VideoMetadata(total_num_frames=len(picks), fps=float(fps), frames_indices=picks.tolist(),
                             height=cfg.height, width=cfg.width)
    encoded = processor(text=[processor.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)],
                        videos=[frames], video_metadata=[metadata], return_tensors="pt",
                        videos_kwargs={"do_resize": False, "do_sample_frames": False, "return_metadata": True})
    tokenizer = processor.tokenizer
    prompt_ids = encoded["input_ids"][0].tolist()
    markers = prompt_timestamps(tokenizer.decode(prompt_ids))
    shown = [any(a <= i < b for a, b in intervals) for i in picks[::2]]
    if len(markers) != len(shown):
        raise RuntimeError(f"the processor marked {len(markers)} times for {len(shown)} frame pairs")
    answer = ", ".join(f"{time:.1f}" for time, seen in zip(markers, shown) if seen) or NEVER
    input_ids = prompt_ids + tokenizer(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    answer_length = len(input_ids) - len(prompt_ids)
    return {
        "input_ids": torch.tensor(input_ids),
        "labels": torch.tensor(assistant_labels(input_ids, tokenizer, answer)),
        "mm_token_type_ids": torch.cat([encoded["mm_token_type_ids"][0],
                                        torch.zeros(answer_length, dtype=torch.int)]),
        "pixel_values_videos": encoded["pixel_values_videos"],
        "video_grid_thw": encoded["video_grid_thw"],
        "prompt_length": len(prompt_ids),
        "answer": answer,
    }


def pretraining_batch(samples: list[dict], pad_id: int, prompt_only: bool = False) -> dict:
    import torch

    def cut(sample, key):
        return sample[key][: sample["prompt_length"]] if prompt_only else sample[key]

    length = max(len(cut(s, "input_ids")) for s in samples)

    def padded(key: str, fill: int):
        return torch.stack([torch.nn.functional.pad(cut(s, key), (0, length - len(cut(s, key))), value=fill)
                            for s in samples])

    batch = {
        "input_ids": padded("input_ids", pad_id),
        "attention_mask": torch.stack([torch.arange(length) < len(cut(s, "input_ids")) for s in samples]).long(),
        "mm_token_type_ids": padded("mm_token_type_ids", 0),
        "pixel_values_videos": torch.cat([s["pixel_values_videos"] for s in samples]),
        "video_grid_thw": torch.cat([s["video_grid_thw"] for s in samples]),
    }
    if not prompt_only:
        batch["labels"] = padded("labels", -100)
    return batch


def held_out_accuracy(model, samples: list[dict], tokenizer) -> float:
    """Exact-match rate of greedy answers (one clip at a time: no left padding needed)."""
    import torch

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    right = 0
    model.eval()
    with torch.no_grad():
        for sample in samples:
            batch = pretraining_batch([sample], tokenizer.pad_token_id, prompt_only=True)
            output = model.generate(**batch, max_new_tokens=32, do_sample=False, eos_token_id=end,
                                    pad_token_id=tokenizer.pad_token_id)
            right += tokenizer.decode(output[0, sample["prompt_length"]:], skip_special_tokens=True) == sample["answer"]
    return right / len(samples)


def pretrain(model, processor, cfg: View, system: str) -> dict:
    """Full-parameter training of the language model (the vision tower stays as built) on rendered clips."""
    import time

    import torch

    pretrain_cfg = cfg.pretrain
    if cfg.height % 32 or cfg.width % 32:
        raise ValueError(f"demo.pretrain needs demo.height and demo.width in multiples of 32 (patch 16 x merge 2), "
                         f"not {cfg.height}x{cfg.width}")
    started = time.perf_counter()
    rng = np.random.default_rng(cfg.seed + 1)  # not the pipeline videos' stream
    samples = [pretraining_sample(rng, cfg, processor, system) for _ in range(pretrain_cfg.clips)]
    held_out, train = samples[: pretrain_cfg.held_out], samples[pretrain_cfg.held_out:]
    torch.manual_seed(cfg.seed)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".visual." not in f".{name}")
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=pretrain_cfg.lr, weight_decay=0.0)
    steps, batch_size = pretrain_cfg.steps, pretrain_cfg.batch_size
    order = torch.randperm(len(train) * (steps * batch_size // len(train) + 1)) % len(train)
    model.train()
    losses = []
    for step in range(steps):
        warm = min(1.0, (step + 1) / 20)  # a short warm-up, then a cosine to a tenth
        for group in optimizer.param_groups:
            group["lr"] = pretrain_cfg.lr * warm * (0.1 + 0.45 * (1 + np.cos(np.pi * step / steps)))
        rows = [train[i] for i in order[step * batch_size:(step + 1) * batch_size].tolist()]
        loss = model(**pretraining_batch(rows, processor.tokenizer.pad_token_id), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"pretrain step {step} loss {loss.item():.4f}", flush=True)
    accuracy = held_out_accuracy(model, held_out, processor.tokenizer)
    facts = {"steps": steps, "clips": len(train), "held_out": len(held_out), "first_loss": losses[0],
             "last_loss": losses[-1], "held_out_exact_match": accuracy, "seconds": time.perf_counter() - started,
             "example": {"answer": held_out[0]["answer"]}}
    print(f"pretrain: held-out exact match {accuracy:.3f} after {steps} steps (loss {losses[0]:.3f} -> {losses[-1]:.4f})")
    if accuracy < pretrain_cfg.min_exact_match:
        raise RuntimeError(f"the pretrained base answers {accuracy:.0%} of held-out clips exactly, under "
                           f"demo.pretrain.min_exact_match={pretrain_cfg.min_exact_match}: raise demo.pretrain.steps")
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "demo")
    with run_record("demo", args.out, cfg, args) as record:
        rows = make_videos(cfg.demo, args.out / "videos", args.out / "annotations.jsonl")
        model_facts = build_model_dir(cfg.demo, args.out / "model", cfg.prompt.system)
        record["results"] = {"videos": len(rows), "model": model_facts}
        write_json(args.out / "demo.json", record["results"])
    print(f"demo: {len(rows)} videos, model with {model_facts['parameters']} parameters in {args.out}")
    return 0


if __name__ == "__main__":
    exit_after(main)

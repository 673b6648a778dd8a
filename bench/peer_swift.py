"""ms-swift on the samples our train stage reads (issue 36): the same windows in ms-swift's own dataset
format, and `swift sft` in an environment of its own, each step timed on the device.

    python bench/peer_swift.py --manifest DATA/manifest.json --model DIR --work W \\
        --swift-python python3 --swift-path /tmp/swift-site:/tmp/site --settings ours [--steps 8]
    python bench/peer_swift.py --smoke --work W --swift-python /tmp/swenv/bin/python   # CPU, 2 steps

ms-swift pins transformers < 5.20 and peft < 0.21, older than ours, so it never runs in the project's
environment: ``--swift-python`` is an interpreter where ms-swift imports (``--swift-path`` is its
PYTHONPATH, in place of ours). On the GPU machine that is the image's Python (transformers 5.17)
with a folder made by ``pip install --no-deps --target`` for cp312 of ms-swift 4.6.0 and what it
imports beyond the image (its pip list in a CPU venv here: modelscope, trl 0.29, datasets 4.8, peft
0.20, addict, attrdict, binpacking, dacite, json-repair, simplejson, sortedcontainers, zstandard,
transformers-stream-generator, cryptography, ...) and qwen-vl-utils, then, after it, the folder of
packages our runs carry (decord, deepspeed, flash-linear-attention: ms-swift's Qwen3.5 finds fla's
kernels as ours do; the newer transformers and peft there are shadowed by its own); for
``recommended`` also liger-kernel and a flash-attention build (its packing refuses SDPA). ``bench/train_throughput.py --trainers ours swift`` runs both on the
same checkpoint and samples in one call; ``bench/packing.py --modes ... swift`` runs it on the
mixed-length set beside our modes (its samples, made in memory, go through ``export_rows``). The
samples are the store's rows of ``--split``:

* the frames the processor was given (the store keeps them; already resized under our per-frame
  budget) as one PNG list per window, which ms-swift's Qwen templates take as a video of exactly
  those frames, ``FPS`` apart (``FPS`` is set to the windows' frame rate);
* ms-swift's per-frame budget (``VIDEO_MIN_TOKEN_NUM`` = ``VIDEO_MAX_TOKEN_NUM``, merged tokens per
  frame pair) set to the stored grid's, so that it keeps the frames at our size: the same visual
  tokens per window;
* our chat (the default prompt config, as the benches' samples have it): the system turn, the user
  turn with the video first and the instruction with the query, the answer text as the assistant turn.

What differs by design, and why step-0 losses are not expected to agree: ms-swift builds its own
prompt from these messages (its Qwen3.5 template puts an empty think block before every answer and
supervises the answer, ``<|im_end|>`` *and* the newline after it; ours supervises the answer and
``<|im_end|>``), and reads frames from files with its own timestamps (``<t seconds>`` from 0, FPS
apart; ours are each frame's time in the window). Token counts per window are recorded for both.

Settings (``--settings``):

* ``ours``: the closest to the train stage: LoRA on the same modules and rank, bf16, gradient
  checkpointing, frozen vision tower, one window per step, no packing, SDPA attention, DeepSpeed
  ZeRO-3 (on a GPU).
* ``recommended``: ms-swift's documentation for Qwen3.5 / Qwen3-VL (BestPractices, 4.6): the same LoRA,
  plus ``--packing true`` (padding-free, flash attention), ``--use_liger_kernel true``,
  ``--attn_impl flash_attn`` and ZeRO-2 (its Qwen3.5-4B recipe's); needs flash-attn, liger-kernel and
  deepspeed in ms-swift's environment. No flash-attn (FA2) wheel exists for the GPU image's torch
  2.11 and it cannot be built there; ``--attn-impl flash_attention_4`` runs the one flash attention
  that installs from wheels alone (flash-attn-4, CuTe DSL kernels compiled on first use, Hopper and
  newer), which ms-swift's packing also accepts.

fla 0.6.0 refuses its gated backward pass on Hopper GPUs with Triton >= 3.4, < 3.7.1 (its issue
#640: wrong gradients at some shapes) unless tilelang is installed. Our train stage turns that guard
off only after its own check has found the kernel's output and gradients within bounds of the
reference at every layer shape of the model (videosft.kernels.gated_deltanet); ms-swift has no such
check and stops at the guard. So that both trainers run the same kernel, ms-swift's process turns the
guard off the same way (``--fla-hopper-guard off``, the default; the command line records it); with
``keep`` a run on such a machine fails as a user's would, until Triton or tilelang is upgraded.

fla autotunes each kernel the first time it meets a key, and some keys follow the sequence length: on
a fresh machine ms-swift's first step at 128 frames took 146 s, and on windows of mixed lengths a new
length can autotune inside a timed step (about 20 s each). Our runs restore fla's choices from the table
committed for the GPU model (videosft.kernels.autotune, nearest choice for a new length); so that the
steps compare the trainers rather than when each autotunes, ms-swift's process restores the same table
before it trains (``--autotune ours``, the default, recorded in its command line; ``own`` lets it
autotune as its users' runs do).

Each step is timed by a callback (``STEP_TIMER``) between ``on_step_begin`` and ``on_step_end``,
the device synchronized at both ends, with the tokens it read (the difference of transformers'
``num_input_tokens_seen``, padding-free so real tokens) and the peak allocated and reserved memory of
that step; the summary's tokens/s is the median over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SETTINGS = ("ours", "recommended")


def default_lora() -> dict:
    """The config's LoRA defaults: what the train stage fits when train_throughput runs ``ours``."""
    from videosft import config as config_lib

    return config_lib.resolve({})["lora"]

# flash-attn-4 4.0.0b36 takes max_seqlen_q/k as Python ints; transformers 5.17's padding-free path hands it the
# 0-d tensor it computed (it converts only while tracing) and CuTe stops at its first layer ("Expected IntTuple,
# whose leaves are integers"). Given as ints, as FA2's binding converts them; transformers looks the function up
# at its first forward, so this is in place before.
FA4_SEQLEN_AS_INT = r'''
if os.environ.get("PEER_FA4_SEQLEN_AS_INT") == "1":
    import flash_attn.cute as fa4
    def _seqlen_as_int(*args, _varlen=fa4.flash_attn_varlen_func, **kwargs):
        for key in ("max_seqlen_q", "max_seqlen_k"):
            if kwargs.get(key) is not None and not isinstance(kwargs[key], int):
                kwargs[key] = int(kwargs[key])
        return _varlen(*args, **kwargs)
    fa4.flash_attn_varlen_func = _seqlen_as_int
'''

# Run with ms-swift's interpreter: argv[1] the step log, the rest swift sft's arguments. videosft's kernel
# helpers (fla's Hopper guard, our autotune table) come from this tree's src, after ms-swift's packages.
STEP_TIMER = r'''
import json, os, site, sys, time
# Folders made by `pip install --target` are on PYTHONPATH, where Python does not read .pth files:
# read them as site-packages' would be (nvidia-cutlass-dsl, under flash-attn-4, puts its packages on the path so).
for folder in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    site.addsitedir(folder)
''' + FA4_SEQLEN_AS_INT + r'''
import torch
from swift.callbacks import callbacks_map
from swift.callbacks.base import TrainerCallback
from swift.pipelines.train.sft import sft_main

class StepTimer(TrainerCallback):
    def __init__(self, args, trainer):
        super().__init__(args, trainer)
        self.log, self.started, self.seen = open(STEPS, "w"), None, 0

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        seconds = time.perf_counter() - self.started
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        gpu = torch.cuda.is_available()
        self.log.write(json.dumps({"step": state.global_step - 1, "step_seconds": seconds, "tokens": seen - self.seen,
                                   "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0,
                                   "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if gpu else 0.0}) + "\n")
        self.log.flush()
        self.seen = seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.log.write(json.dumps({"step": state.global_step - 1, "loss": logs["loss"]}) + "\n")
            self.log.flush()

STEPS = sys.argv[1]
sys.path.append(os.environ["PEER_VIDEOSFT_SRC"])  # after ms-swift's own packages: only videosft comes from it
from videosft.kernels import autotune, gated_deltanet
if os.environ.get("PEER_FLA_HOPPER_GUARD") == "off" and gated_deltanet.fla_status()["importable"]:
    gated_deltanet.bypass_hopper_guard()
if os.environ.get("PEER_AUTOTUNE") == "ours" and torch.cuda.is_available():
    print("fla's kernel choices:", autotune.summary(autotune.apply(torch.device("cuda"))), flush=True)
# a simulated smaller card, as ours under train.memory_cap_gib (torch.cuda.set_per_process_memory_fraction)
if os.environ.get("PEER_MEMORY_CAP_GIB") and torch.cuda.is_available():
    from videosft.training.setup import cap_device_memory
    cap_device_memory(float(os.environ["PEER_MEMORY_CAP_GIB"]), "cuda:0")
callbacks_map["videosft_step_timer"] = StepTimer
sft_main(sys.argv[2:] + ["--callbacks", "videosft_step_timer"])
'''


def frames_per_second(times: list[float]) -> float:
    """The rate of frames ``times`` apart on average (ms-swift spaces a frame list evenly)."""
    if len(times) < 2 or times[-1] <= times[0]:
        raise ValueError(f"frame times {times[:3]}... do not advance")
    return (len(times) - 1) / (times[-1] - times[0])


def export(manifest: Path, split: str, out: Path) -> dict:
    """The store's ``split`` rows as ms-swift's dataset (``export_rows``)."""
    from videosft.data.sample_store import read_manifest, read_samples

    rows = read_samples(manifest, split)
    if not rows:
        raise SystemExit(f"{manifest}: no {split} samples")
    return export_rows(rows, read_manifest(manifest)["geometry"]["merge_size"], out, str(manifest))


def export_rows(rows: list[dict], merge_size: int, out: Path, source: str = "the samples") -> dict:
    """Samples as the store holds them (``frames``/``frames_shape``, ``frame_times``, ``video_grid_thw``,
    ``query``, ``answer``, ``input_tokens``), in their order, as ms-swift's JSONL (``out``/swift.jsonl) with
    each window's frames as PNG files; the environment ms-swift must read them with (frame rate,
    per-frame budget), and our token counts per window. ``merge_size`` is the processor's spatial merge
    (the store's manifest records it); ``source`` names the samples in errors."""
    from PIL import Image

    from videosft import config as config_lib
    from videosft.encoding.chat import messages
    from videosft.media.pixels import frames_of

    prompt = config_lib.for_stage("preprocess", {}).prompt  # the store does not record it: the benches use the default
    grids = {(row["video_grid_thw"][1], row["video_grid_thw"][2]) for row in rows}
    if len(grids) != 1:
        raise SystemExit(f"{source}: frames of {len(grids)} sizes ({sorted(grids)}); ms-swift takes one "
                         "per-frame budget per run")
    (height, width), = grids
    rates = [frames_per_second(row["frame_times"]) for row in rows]
    lines = []
    for index, row in enumerate(rows):
        folder = out / "frames" / f"{index:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        files = []
        for number, frame in enumerate(frames_of(row).permute(0, 2, 3, 1).numpy()):
            files.append(str((folder / f"{number:04d}.png").resolve()))
            Image.fromarray(frame).save(files[-1], compress_level=1)
        turns = []
        for turn in messages(prompt, row["query"], row["answer"]):
            content = turn["content"]
            if isinstance(content, list):  # our user turn: the video, then the instruction
                content = "".join("<video>" if part["type"] == "video" else part["text"] for part in content)
            turns.append({"role": turn["role"], "content": content})
        lines.append(json.dumps({"messages": turns, "videos": [files]}))
    (out / "swift.jsonl").write_text("\n".join(lines) + "\n")
    per_pair = height * width // merge_size ** 2  # merged tokens per frame pair
    env = {"FPS": f"{statistics.median(rates):.6g}", "VIDEO_MIN_TOKEN_NUM": str(per_pair),
           "VIDEO_MAX_TOKEN_NUM": str(per_pair), "FPS_MAX_FRAMES": str(max(len(r["frame_times"]) for r in rows))}
    facts = {"samples": len(rows), "env": env, "our_input_tokens": [row["input_tokens"] for row in rows],
             "frames": [len(row["frame_times"]) for row in rows], "fps_range": [min(rates), max(rates)]}
    (out / "export.json").write_text(json.dumps(facts, indent=1))
    return facts


def deepspeed_stage(settings: str, requested: str | None = None) -> str | None:
    """The DeepSpeed stage ms-swift runs under on a GPU: ``requested`` ("zero2", "zero3", "none"), else the
    settings' own (ours: ZeRO-3 as the train stage; recommended: ZeRO-2, its recipe's); None for none."""
    stage = requested or ("zero3" if settings == "ours" else "zero2")
    return None if stage == "none" else stage


def swift_arguments(model: Path, model_type: str, dataset: Path, out: Path, settings: str, steps: int | None,
                    lora: dict, device: str, max_length: int, deepspeed: str | None = None,
                    attn_impl: str = "flash_attn", epochs: int = 1) -> list[str]:
    """`swift sft`'s arguments for ``settings`` (module docstring); ``deepspeed`` ("zero2", "zero3" or
    "none") in place of the settings' own stage on a GPU; ``steps`` None: ``epochs`` epochs (packs are made
    by ms-swift, so their count is its own); ``attn_impl`` the flash attention ``recommended`` runs
    (ms-swift's packing takes flash_attn, flash_attention_2, _3 or _4)."""
    args = ["--model", str(model), "--model_type", model_type, "--template", model_type, "--check_model", "false",
            "--dataset", str(dataset), "--tuner_type", "lora", "--lora_rank", str(lora["r"]),
            "--lora_alpha", str(lora["alpha"]), "--lora_dropout", str(lora["dropout"]),
            "--target_modules", *lora["target_modules"], "--freeze_vit", "true", "--freeze_aligner", "true",
            "--gradient_checkpointing", "true", "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "1",
            *(["--max_steps", str(steps)] if steps else ["--num_train_epochs", str(epochs)]), "--learning_rate", "2e-4",
            "--max_length", str(max_length), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--dataloader_num_workers", "1", "--include_num_input_tokens_seen", "true", "--output_dir", str(out),
            "--dataset_shuffle", "false", "--train_dataloader_shuffle", "false", "--split_dataset_ratio", "0"]
    if device == "cpu":
        args += ["--torch_dtype", "float32", "--use_cpu", "true"]
    else:
        stage = deepspeed_stage(settings, deepspeed)
        args += ["--torch_dtype", "bfloat16"] + (["--deepspeed", stage] if stage else [])
    if settings == "recommended":
        args += ["--attn_impl", attn_impl, "--packing", "true", "--use_liger_kernel", "true"]
    else:
        args += ["--attn_impl", "sdpa"]
    return args


def run_swift(opts, facts: dict, out: Path, settings: str) -> dict:
    """`swift sft` under STEP_TIMER in ms-swift's own environment; its steps and the command."""
    model_type = json.loads((opts.model / "config.json").read_text())["model_type"]
    run_dir = out / settings
    run_dir.mkdir(parents=True, exist_ok=True)
    attn_impl = getattr(opts, "attn_impl", "flash_attn")
    args = swift_arguments(opts.model, model_type, out / "swift.jsonl", run_dir / "output", settings, opts.steps,
                           opts.lora, opts.device, opts.max_length, getattr(opts, "deepspeed", None), attn_impl,
                           getattr(opts, "epochs", 1))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(facts["env"], HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               MODELSCOPE_OFFLINE="1")
    if opts.swift_path:
        env["PYTHONPATH"] = opts.swift_path
    if opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(PEER_VIDEOSFT_SRC=str(ROOT / "src"), PEER_FLA_HOPPER_GUARD=getattr(opts, "fla_hopper_guard", "off"),
               PEER_AUTOTUNE=getattr(opts, "autotune", "ours"),
               PEER_MEMORY_CAP_GIB=str(getattr(opts, "memory_cap_gib", 0.0) or ""),
               PEER_FA4_SEQLEN_AS_INT="1" if settings == "recommended" and attn_impl == "flash_attention_4" else "")
    if env["PEER_FA4_SEQLEN_AS_INT"]:
        # flash-attn-4 compiles its kernels in each new process (147 s at 128 frames) unless its disk cache is on:
        # then a machine's second run (another frame count, the mixed set) starts at once
        env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    steps_file = run_dir / "steps.jsonl"
    command = [opts.swift_python, "-c", STEP_TIMER, str(steps_file), *args]
    started = time.perf_counter()
    with open(run_dir / "swift.log", "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir).returncode
    shown = " ".join(f"{key}={value}" for key, value in facts["env"].items())
    if env["PEER_FLA_HOPPER_GUARD"] == "off":
        shown += " (fla's Hopper guard off)"
    if env["PEER_AUTOTUNE"] == "ours":
        shown += " (fla's choices from our autotune table)"
    if env["PEER_FA4_SEQLEN_AS_INT"]:
        shown += " (flash-attn-4 given max_seqlen as int)"
    if env["PEER_MEMORY_CAP_GIB"]:
        shown += f" (under a simulated {env['PEER_MEMORY_CAP_GIB']} GiB card: torch.cuda.set_per_process_memory_fraction)"
    result = {"settings": settings, "returncode": code, "seconds": time.perf_counter() - started,
              "command": f"{shown} swift sft {' '.join(args)}", "log": str(run_dir / "swift.log")}
    if code == 0 and steps_file.exists():
        result.update(summarize(steps_file))
    return result


def summarize(steps_file: Path) -> dict:
    """Per-step records merged; tokens/s and step time as medians over the steps after the first (each
    step's tokens and seconds are kept, for a caller that aggregates as it does its own steps)."""
    steps: dict[int, dict] = {}
    for line in steps_file.read_text().splitlines():
        entry = json.loads(line)
        steps.setdefault(entry["step"], {}).update(entry)
    ordered = [steps[k] for k in sorted(steps)]
    timed = [s for s in ordered[1:] if "step_seconds" in s] or [s for s in ordered if "step_seconds" in s]
    if not timed:
        return {"steps": 0}
    return {"steps": len(ordered), "step0_loss": ordered[0].get("loss"),
            "tokens_per_step": [s.get("tokens") for s in ordered],
            "seconds_per_step": [s.get("step_seconds") for s in ordered],
            "tokens_per_second": statistics.median(s["tokens"] / s["step_seconds"] for s in timed),
            "step_seconds": statistics.median(s["step_seconds"] for s in timed),
            "peak_allocated_gib": max(s["peak_allocated_gib"] for s in ordered if "peak_allocated_gib" in s),
            "peak_reserved_gib": max(s["peak_reserved_gib"] for s in ordered if "peak_reserved_gib" in s)}


def smoke_inputs(work: Path) -> tuple[Path, Path]:
    """A tiny Qwen3.5 with the real vocabulary (ms-swift's templates find the vision tokens by their
    published ids) and a store of three windows made by the preprocess stage's own code."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "bench"))
    import published
    from gpu_pipeline import build_samples

    model = published.published_qwen35(work / "model")
    data = work / "data"
    cfg = {"model": {"path": str(model)}, "video": {"max_frames": 8, "max_tokens": 16}}
    build_samples(cfg, data, 3, 8.0, 2)
    return model, data / "manifest.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, help="a preprocess manifest (our sample store)")
    parser.add_argument("--model", type=Path, help="the checkpoint both trainers load (the real vocabulary)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--split", default="train")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=65536)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--swift-python", default=sys.executable, help="an interpreter where ms-swift imports")
    parser.add_argument("--swift-path", help="ms-swift's PYTHONPATH, in place of ours: its own packages first, then "
                        "(joined by ':') a folder with flash-linear-attention and deepspeed for it to find")
    parser.add_argument("--fla-hopper-guard", default="off", choices=["off", "keep"],
                        help="off (default): run fla's gated backward on Hopper with Triton < 3.7.1 as our train "
                        "stage does after its kernel check; keep: let fla refuse it (then ms-swift needs tilelang "
                        "or Triton >= 3.7.1)")
    parser.add_argument("--autotune", default="ours", choices=["ours", "own"],
                        help="ours (default): fla's kernel choices from our committed table for this GPU model, as "
                        "our runs have them; own: ms-swift's fla autotunes each new key, inside the timed steps")
    parser.add_argument("--attn-impl", default="flash_attn",
                        choices=["flash_attn", "flash_attention_2", "flash_attention_3", "flash_attention_4"],
                        help="the flash attention of the recommended settings: flash_attn (its documentation's, "
                        "FA2) or another its packing accepts, as installed in its environment (FA4: flash-attn-4)")
    parser.add_argument("--memory-cap-gib", type=float, default=0.0,
                        help="a simulated card of this size (torch.cuda.set_per_process_memory_fraction), as "
                        "train.memory_cap_gib does for ours")
    parser.add_argument("--lora", type=json.loads, default=None, help="LoRA as JSON (default: the config's)")
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny real-vocabulary Qwen3.5, 2 steps")
    opts = parser.parse_args(argv)
    opts.lora = opts.lora or default_lora()
    opts.work.mkdir(parents=True, exist_ok=True)
    if opts.smoke:
        opts.device, opts.steps, opts.settings = "cpu", 2, ["ours"]
        opts.model, opts.manifest = smoke_inputs(opts.work)
    if not (opts.model and opts.manifest):
        parser.error("--model and --manifest (or --smoke)")
    facts = export(opts.manifest, opts.split, opts.work / "swift-data")
    results = {"export": facts, "runs": [run_swift(opts, facts, opts.work / "swift-data", s) for s in opts.settings]}
    (opts.work / "peer_swift.json").write_text(json.dumps(results, indent=1))
    for run in results["runs"]:
        print(f"{run['settings']:<12} rc={run['returncode']} steps={run.get('steps', 0)} "
              f"tokens/s={run.get('tokens_per_second', 0):,.0f} step_s={run.get('step_seconds', 0):.3f} "
              f"peak_alloc={run.get('peak_allocated_gib', 0):.2f} GiB step0_loss={run.get('step0_loss')}")
    return 0 if all(run["returncode"] == 0 and run.get("steps") for run in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

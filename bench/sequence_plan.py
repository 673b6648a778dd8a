"""The memory planner's per-rank prediction with train.sequence_parallel n (no GPU needed).

    python bench/sequence_plan.py --config bench/configs/Qwen3.5-4B.json --frames 128 256 512 --sizes 1 2 4 --limit-gib 12

The model is built on the meta device from a published config (no weights); the sample is a window of
448x448 frames at the train-throughput runs' geometry: 196 visual tokens per frame pair, 10 text tokens
per further pair (its time marker and vision start / end), 210 prompt tokens, 40 supervised; at 128
frames 13,384 tokens, as measured there (bench/RESULTS.md). Options as the train stage's defaults on a
GPU with fla (bf16, gradient checkpointing, whole-block gathering, the default DeepSpeed config, LoRA
as in config.yaml). Per frame count and n: the predicted peak per rank of one sample shared by n
cards (world = n), and the most frames per sample that n cards of --limit-gib hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PAIR_TOKENS, TEXT_PER_PAIR, PROMPT, SUPERVISED = 196, 10, 210, 40


def sample(frames: int):
    from videosft.training.memory import SampleFacts

    pairs = frames // 2
    visual = PAIR_TOKENS * pairs
    return SampleFacts(PROMPT + visual + TEXT_PER_PAIR * (pairs - 1), visual, SUPERVISED, frames, TEXT_PER_PAIR)


def main() -> None:
    import torch
    from transformers import AutoConfig

    from videosft import config as config_lib
    from videosft.models.checkpoint import model_class
    from videosft.models.lora import coverage
    from videosft.training.memory import PlanOptions, largest_frames, model_facts, plan_peak

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "bench/configs/Qwen3.5-4B.json")
    parser.add_argument("--frames", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--limit-gib", type=float, default=12.0)
    args = parser.parse_args()
    config = AutoConfig.for_model(**json.loads(args.config.read_text()))
    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    cfg = config_lib.resolve({})
    ds_zero = json.loads((ROOT / cfg["train"]["deepspeed_config"]).read_text())["zero_optimization"]
    facts = model_facts(model, int(ds_zero.get("stage3_param_persistence_threshold", 1e5)))
    trainable = coverage(model, cfg["lora"]["target_modules"], cfg["lora"]["r"])["trainable_parameters"]
    train = config_lib.section("train")
    options = PlanOptions.of(train, kernels="fla")
    print(f"{args.config.name}: {facts.parameters / 1e9:.2f}B parameters, LoRA {trainable:,} trainable; "
          f"options {options.peak}; card {args.limit_gib} GiB\n")
    print("| frames | tokens | n (cards sharing the sample) | per-rank reserved GiB | allocated GiB | "
          "activations GiB | exchange GiB | fits | most frames on n cards |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    most = {n: largest_frames(facts, sample(128), trainable, n, ds_zero, args.limit_gib,
                              **{**options.peak, "sequence_parallel": n}) for n in args.sizes}
    for frames in args.frames:
        for n in args.sizes:
            peak = plan_peak(facts, sample(frames), trainable, n, ds_zero, **{**options.peak, "sequence_parallel": n})
            parts = peak["components_gib"]
            print(f"| {frames} | {sample(frames).input_tokens:,} | {n} | {peak['reserved_gib']:.2f} | "
                  f"{peak['allocated_gib']:.2f} | {parts['activations_checkpointed_layers']:.2f} | "
                  f"{parts['sequence_exchange']:.2f} | {'yes' if peak['reserved_gib'] <= args.limit_gib else 'no'} | "
                  f"{most[n]} |")


if __name__ == "__main__":
    main()

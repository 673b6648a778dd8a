"""What ZeRO-3 costs the host at one rank, on the host alone.

    python bench/one_rank_zero3.py [--model-config bench/configs/Qwen3.5-4B.json --steps 10 --repeats 2]

On one GPU ZeRO-3 partitions nothing (a rank's partition is the whole tensor), yet its hooks still run
around every block in the forward, the recomputed forward and the backward, and its optimizer wraps
the LoRA parameters; the 12 GiB one-GPU plan's step leaves the device idle over half its time
(bench/RESULTS.md), so that host work is on its critical path. This measures it apart from the
device: the model config's module structure (its decoder layers with their layer types, its vision
blocks) at tiny widths, on one CPU thread, the train stage's pieces around it (whole-decoder-layer
checkpointing, every language-model linear layer adapted by LoRA r 16), one video sample of 216
tokens, trained in fp32:

* ``plain``: autograd and the train stage's clipping AdamW (``setup.clipped_adamw``), no DeepSpeed;
* ``stage0``: how the train stage runs one rank since this bench's first finding: the same model, whole,
  through DeepSpeed's engine at stage 0 as ``setup.deepspeed_config`` fills it for one rank, with the
  stage's clipping optimizer (``setup.clipped_adamw``): what DeepSpeed's engine still costs there;
* ``zero3``: the same model built partitioned (``workflow/deepspeed/zero3.json`` filled by the train
  stage's own ``setup.deepspeed_config`` as for a GPU rank under ``train.zero3_on_one_rank``, run on one
  gloo rank) with whole-block gathering, through DeepSpeed's engine (its forward, backward and step).

Each mode runs in a process of its own, the modes alternating over ``--repeats``; per run the median
step (after the first two) and its forward, backward and optimizer parts. The compute is the same in
every mode (the same shapes; the weights differ, zero3's being initialised inside ``zero.Init``, so
the losses do too), so the differences are DeepSpeed's own host work at this structure, on this CPU.
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
MODES = ("plain", "stage0", "zero3")
FRAME_PAIRS, PATCHES = 8, 8  # the sample's video: 8 frame pairs of 8 x 8 patches, 16 merged tokens each


def tiny_config(real: dict):
    """The real config's layer types and block counts at tiny widths."""
    from transformers import Qwen3_5Config

    text = dict(real["text_config"], vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_hidden_layers=0, dtype="float32")
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1])
    text.pop("eos_token_id", None)
    vision = dict(real["vision_config"], hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=500, video_token_id=501,
                         vision_start_token_id=502, vision_end_token_id=503, tie_word_embeddings=True)


def sample() -> dict:
    """A prompt, the video (each frame pair between its start and end tokens, after a time marker) and
    an answer, supervised whole."""
    import torch

    ids, types = list(range(10, 42)), [0] * 32
    merged = (PATCHES // 2) ** 2
    for _ in range(FRAME_PAIRS):
        ids += [20, 502] + [501] * merged + [503]
        types += [0, 0] + [2] * merged + [0]
    ids += list(range(50, 82))
    types += [0] * 32
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long), "labels": torch.tensor([ids]),
            "pixel_values_videos": torch.randn(FRAME_PAIRS * PATCHES * PATCHES, 3 * 2 * 16 * 16, generator=generator),
            "video_grid_thw": torch.tensor([[FRAME_PAIRS, PATCHES, PATCHES]])}


def train_config():
    """The train section's defaults (one sample a step, gradients clipped as the stage clips them)."""
    from videosft import config

    return config.section("train")


def deepspeed_config(mode: str) -> dict:
    """``zero3.json`` as the train stage fills it for one rank of a GPU run, in fp32: without ZeRO
    (``stage0``) or under ``train.zero3_on_one_rank`` (``zero3``; NCCL's settings: gloo's one blocking
    gather at a time after each step is a CPU run's cost, not the GPU's this stands in for; one rank
    gathers nothing anyway)."""
    from videosft.training import setup

    return setup.deepspeed_config(ROOT / "workflow" / "deepspeed" / "zero3.json",
                                  train_config().replace(zero3_on_one_rank=mode == "zero3"), 1, "fp32", "nccl")


def build(mode: str, config):
    """The model with the train stage's checkpointing and LoRA (and, for zero3, partitioned and gathered
    in whole blocks); its trainable parameters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    from videosft.models.lora import target_module_names
    from videosft.training import setup

    torch.manual_seed(0)
    keep_alive = None
    if mode == "zero3":
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(deepspeed_config(mode))  # transformers builds inside zero.Init while it lives
        model = Qwen3_5ForConditionalGeneration._from_config(config)
    else:
        model = Qwen3_5ForConditionalGeneration(config)
    setup.enable_checkpointing(model, offload=False, pin_memory=False)
    if mode == "zero3":
        setup.gather_whole_blocks(model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32,
                                             target_modules=target_module_names(model, ["all-linear"])))
    return model, [p for p in model.parameters() if p.requires_grad], keep_alive


def run(mode: str, model_config: Path, steps: int) -> dict:
    """One mode's steps in this process: per step its forward, backward and optimizer seconds."""
    import torch

    from videosft.training import setup

    torch.set_num_threads(1)
    engine = mode in ("stage0", "zero3")
    if engine:
        setup.init_distributed(seed=0, timeout_s=600)  # one gloo rank, as the train stage starts it on a CPU
    model, trainable, _keep_alive = build(mode, tiny_config(json.loads(model_config.read_text())))
    # zero3's ZeRO optimizer clips itself (deepspeed_config fills gradient_clipping); the others as the stage does
    optimizer = torch.optim.AdamW(trainable, lr=1e-4) if mode == "zero3" else setup.clipped_adamw(trainable, train_config())
    if engine:
        import deepspeed

        model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(mode),
                                                      model_parameters=trainable, dist_init_required=False)
    model.train()
    batch, parts = sample(), []
    for _ in range(steps):
        started = time.perf_counter()
        loss = model(**batch, use_cache=False).loss
        forward = time.perf_counter()
        if engine:
            model.backward(loss)
            backward = time.perf_counter()
            model.step()
        else:
            loss.backward()
            backward = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        parts.append((forward - started, backward - forward, time.perf_counter() - backward))
    later = parts[2:] or parts
    figures = {name: statistics.median(part[i] for part in later)
               for i, name in enumerate(("forward", "backward", "optimizer"))}
    return {"mode": mode, "step_s": statistics.median(sum(p) for p in later), **figures,
            "tokens": int(batch["input_ids"].numel()), "lora_tensors": len(trainable), "loss": loss.item(),
            "zero_stage": model.zero_optimization_stage() if engine else None}


def in_process(mode: str, model_config: Path, steps: int) -> dict:
    """``run`` in a fresh process (one gloo rank of its own for DeepSpeed's modes), its result read from its last
    line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 500), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--run", mode, "--model-config", str(model_config),
                           "--steps", str(steps)], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", type=Path, default=ROOT / "bench" / "configs" / "Qwen3.5-4B.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)  # one mode, in the process in_process starts
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run(args.run, args.model_config, args.steps)), flush=True)
        return
    runs = [in_process(mode, args.model_config, args.steps) for _ in range(args.repeats) for mode in MODES]
    plain = statistics.median(r["step_s"] for r in runs if r["mode"] == "plain")
    print(json.dumps({"model_config": str(args.model_config), "steps": args.steps, "runs": runs}))
    print(f"\n{args.model_config.name}'s structure at tiny widths, one CPU thread, {runs[0]['tokens']} tokens, "
          f"{runs[0]['lora_tensors']} LoRA tensors; medians of steps 3-{args.steps}")
    print("| run | step s | forward s | backward s | optimizer s | step / plain's median |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        print(f"| {r['mode']} | {r['step_s']:.3f} | {r['forward']:.3f} | {r['backward']:.3f} | {r['optimizer']:.3f} | "
              f"{r['step_s'] / plain:.2f} |")


if __name__ == "__main__":
    main()

"""Stage 4, train: LoRA fine-tuning under DeepSpeed ZeRO-3, one process per device.

    torchrun --nproc_per_node 2 -m videosft.train --config config.yaml \\
        --samples results/preprocess/manifest.json --probe results/probe/probe.json --out results/train

The model is built inside ``deepspeed.zero.Init`` (partitioned as it is created, no full copy
per rank) and loaded from the checkpoint through the probe's key map, one gathered parameter at
a time, writing into the existing ``nn.Parameter``; every entry is then compared with the file.
The vision tower and merger stay frozen (their inputs and weights need no gradient, so they
build no autograd graph); LoRA goes on the language model's modules the probe reported. Each
rank reads its own samples, and every sample a rank consumes is written to its ledger. The
loss is computed from logits at the supervised positions only. The adapter is saved with
gathered, full-shape tensors and no base weights.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import random
import resource
import sys
import time
from pathlib import Path

import numpy as np

from . import config as config_lib
from .chat import IGNORE_INDEX
from .keymap import model_class
from .lora import target_module_names
from .preprocess import read_samples
from .provenance import run_record, stage_parser, write_json

ADAPTER_FILES = {"adapter_model.safetensors", "adapter_config.json", "README.md"}
WORKFLOW_MARKERS = {".snakemake_timestamp"}  # Snakemake stamps directory outputs with this


class DataError(RuntimeError):
    pass


# ---------------------------------------------------------------- data


def load_samples(manifest: Path) -> list[dict]:
    """The train split, in a fixed order (files of an unknown schema version are refused)."""
    rows = read_samples(manifest, "train")
    rows.sort(key=lambda row: row["window_id"])
    if not rows:
        raise DataError(f"{manifest} lists no train samples")
    return rows


def rank_schedule(n_samples: int, world: int, micro_batch: int, tail: str, epoch_seed: int) -> tuple[list[list[int]], dict]:
    """Sample indices per rank for one epoch, and what the tail policy did.

    The epoch order is a seeded shuffle shared by every rank; rank r takes every world-th
    sample from position r. When ``n_samples`` does not divide into ``world * micro_batch``:
    ``pad`` repeats samples from the start of the order, ``drop`` leaves the tail out,
    ``error`` stops. Nothing is left out silently: the returned dict names what was padded or
    dropped.
    """
    order = list(range(n_samples))
    random.Random(epoch_seed).shuffle(order)
    unit = world * micro_batch
    remainder = n_samples % unit
    padded: list[int] = []
    dropped: list[int] = []
    if remainder:
        if tail == "error":
            raise DataError(
                f"{n_samples} train samples do not divide into world size {world} x micro batch {micro_batch}; "
                "set train.tail to pad or drop, or change the data"
            )
        if tail == "pad":
            padded = [order[i % n_samples] for i in range(unit - remainder)]
            order = order + padded
        else:
            dropped = order[n_samples - remainder:]
            order = order[: n_samples - remainder]
    per_rank = [order[rank::world] for rank in range(world)]
    return per_rank, {"padded": padded, "dropped": dropped}


def check_every_rank_has_a_batch(n_samples: int, world: int, micro_batch: int, tail: str) -> None:
    """Under ZeRO-3 a rank without a batch hangs the others; fail at once instead."""
    if tail == "drop" and n_samples < world * micro_batch:
        raise DataError(
            f"{n_samples} train samples for {world} ranks x micro batch {micro_batch}: with train.tail=drop "
            f"ranks {list(range(n_samples // micro_batch, world))} would get no batch and hang ZeRO-3. "
            "Add samples, use train.tail=pad, or run fewer ranks."
        )


def collate(rows: list[dict], pad_id: int):
    import torch

    length = max(len(row["input_ids"]) for row in rows)

    def padded(key: str, fill: int, dtype):
        return torch.tensor([row[key] + [fill] * (length - len(row[key])) for row in rows], dtype=dtype)

    pixels = [np.frombuffer(row["pixel_values"], dtype=np.float16).reshape(row["pixel_shape"]) for row in rows]
    return {
        "input_ids": padded("input_ids", pad_id, torch.long),
        "labels": padded("labels", IGNORE_INDEX, torch.long),
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (length - len(r["input_ids"])) for r in rows]),
        "mm_token_type_ids": padded("mm_token_type_ids", 0, torch.int),
        "pixel_values_videos": torch.from_numpy(np.concatenate(pixels).astype(np.float32)),
        "video_grid_thw": torch.tensor([row["video_grid_thw"] for row in rows], dtype=torch.long),
    }


# ---------------------------------------------------------------- model


def choose_precision(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def deepspeed_config(path: Path, train_cfg: dict, world: int, precision: str) -> dict:
    """The DeepSpeed config file with its "auto" values filled from our config."""
    ds = json.loads(Path(path).read_text())
    ds["train_micro_batch_size_per_gpu"] = train_cfg["micro_batch_size"]
    ds["gradient_accumulation_steps"] = train_cfg["grad_accum"]
    ds["train_batch_size"] = train_cfg["micro_batch_size"] * train_cfg["grad_accum"] * world
    ds["gradient_clipping"] = train_cfg["grad_clip"]
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision == "bf16"}
    ds["fp16"] = {**ds.get("fp16", {}), "enabled": precision == "fp16"}
    ds["zero_allow_untested_optimizer"] = True  # we bring torch's AdamW
    if ds.get("zero_optimization", {}).get("stage") != 3:
        raise ValueError(f"{path}: zero_optimization.stage must be 3")
    leftover = [key for key, value in ds.items() if value == "auto"]
    if leftover:
        raise ValueError(f"{path}: no value for 'auto' keys {leftover}")
    return ds


def build_partitioned_model(model_dir: Path, ds_config: dict):
    """The model, partitioned across ranks as it is built.

    While an ``HfDeepSpeedConfig`` is alive, transformers builds inside ``deepspeed.zero.Init``
    with its own guards (RoPE buffer dtypes, initialisation of partitioned weights); the weights
    are then overwritten from the checkpoint by :func:`load_checkpoint`. The returned config
    object must stay referenced for as long as the model is used.
    """
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)
    config = AutoConfig.from_pretrained(model_dir)
    model = model_class(config)._from_config(config)
    return model, keep_alive


def logical_shape(parameter) -> list[int]:
    """A ZeRO-3 parameter shows shape [0] on each rank; its real shape is ds_shape."""
    return list(getattr(parameter, "ds_shape", parameter.shape))


def load_checkpoint(model, model_dir: Path, key_map: dict, rank: int) -> dict:
    """Copy each checkpoint tensor into the model's existing parameter, one gathered parameter at a time.

    Every rank walks the key map in the same order (gathers are collective). Rank 0 writes into
    the gathered ``nn.Parameter`` (``state_dict(keep_vars=True)`` gives the Parameters, not
    copies); ZeRO re-partitions it on leaving the context. Then every entry is gathered again and
    compared element-wise with the file, cast to the parameter's dtype.
    """
    import deepspeed
    import torch
    from safetensors import safe_open

    state = model.state_dict(keep_vars=True)
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for key, entry in sorted(key_map.items()):
        by_shard.setdefault(entry["shard"], []).append((key, entry["parameter"]))
    started = time.perf_counter()
    for shard, entries in sorted(by_shard.items()):
        with safe_open(model_dir / shard, framework="pt") as handle:
            for key, name in entries:
                target = state[name]
                tensor = handle.get_tensor(key)
                if list(tensor.shape) != logical_shape(target):
                    raise ValueError(f"{key}: checkpoint shape {list(tensor.shape)} vs model {logical_shape(target)}")
                if isinstance(target, torch.nn.Parameter) and hasattr(target, "ds_id"):
                    with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                        if rank == 0:
                            with torch.no_grad():
                                target.data.copy_(tensor.to(target.dtype))
                else:
                    with torch.no_grad():
                        target.data.copy_(tensor.to(target.dtype))
    load_seconds = time.perf_counter() - started

    started = time.perf_counter()
    matched, mismatched = 0, []
    for shard, entries in sorted(by_shard.items()):
        with safe_open(model_dir / shard, framework="pt") as handle:
            for key, name in entries:
                target = state[name]
                source = handle.get_tensor(key)
                gathered = [target] if hasattr(target, "ds_id") else []
                with deepspeed.zero.GatheredParameters(gathered, modifier_rank=None):
                    equal = torch.equal(target.data.detach().cpu(), source.to(target.dtype))
                if equal:
                    matched += 1
                else:
                    mismatched.append(key)
    verify_seconds = time.perf_counter() - started
    if mismatched:
        raise ValueError(f"after loading, {len(mismatched)} of {len(key_map)} entries differ from the checkpoint: "
                         f"{mismatched[:5]}")
    return {"entries": len(key_map), "matched": matched, "load_seconds": load_seconds,
            "verify_seconds": verify_seconds, "summary": f"{matched} of {len(key_map)} entries matched"}


def add_lora(model, lora_cfg: dict, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    for parameter in model.parameters():
        parameter.requires_grad_(False)
    targets = target_module_names(model, lora_cfg["target_modules"])
    if not targets:
        raise ValueError(f"lora.target_modules {lora_cfg['target_modules']} match no module of the language model")
    torch.manual_seed(seed)  # every rank initialises the same LoRA weights before ZeRO partitions them
    peft_config = LoraConfig(r=lora_cfg["r"], lora_alpha=lora_cfg["alpha"], lora_dropout=lora_cfg["dropout"],
                             target_modules=targets, bias="none")
    return get_peft_model(model, peft_config), targets


def lora_parameters(model) -> list[tuple[str, object]]:
    return [(name, p) for name, p in model.named_parameters() if "lora_" in name]


def gathered_lora_state(model) -> dict:
    """Full-shape copies of every LoRA tensor (a collective: every rank must call it)."""
    import deepspeed

    named = lora_parameters(model)
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {name: p.data.detach().cpu().clone() for name, p in named}


def supervised_loss(model, batch: dict):
    """Cross-entropy over the supervised positions only: the LM head never sees the rest."""
    import torch

    labels = batch["labels"]
    targets = labels[:, 1:]
    positions = torch.nonzero((targets != IGNORE_INDEX).any(dim=0)).flatten()
    if positions.numel() == 0:
        raise DataError("a batch has no supervised token")
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs, logits_to_keep=positions, use_cache=False).logits
    chosen = targets[:, positions]
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), chosen.reshape(-1), ignore_index=IGNORE_INDEX
    )


def peak_memory(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def lr_lambda(train_cfg: dict):
    warmup, steps = train_cfg["warmup_steps"], train_cfg["steps"]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


# ---------------------------------------------------------------- the run


def train(cfg: dict, samples_path: Path, probe_path: Path, out: Path, record: dict) -> None:
    import deepspeed
    import torch
    import torch.distributed as torch_dist

    train_cfg = cfg["train"]
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    precision = choose_precision(train_cfg["precision"])
    model_dir = Path(cfg["model"]["path"])
    probe = json.loads(probe_path.read_text())
    if not probe.get("ok"):
        raise ValueError(f"{probe_path} reports a checkpoint that does not fit; rerun the probe and fix it first")

    rows = load_samples(samples_path)
    micro = train_cfg["micro_batch_size"]
    check_every_rank_has_a_batch(len(rows), world, micro, train_cfg["tail"])

    ds_config = deepspeed_config(Path(train_cfg["deepspeed_config"]), train_cfg, world, precision)
    started = time.perf_counter()
    model, _hf_ds_config = build_partitioned_model(model_dir, ds_config)
    load = load_checkpoint(model, model_dir, probe["key_map"], rank)
    load["build_and_load_seconds"] = time.perf_counter() - started
    if train_cfg["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, targets = add_lora(model, cfg["lora"], train_cfg["seed"])
    trainable = [p for _, p in lora_parameters(model)]
    optimizer = torch.optim.AdamW(trainable, lr=train_cfg["lr"], weight_decay=train_cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train_cfg))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
        model_parameters=trainable, dist_init_required=False)
    initial_lora = gathered_lora_state(engine.module)

    pad_id = _pad_id(model_dir)
    steps_log = open(out / f"steps.rank{rank}.jsonl", "w")
    ledger = open(out / f"ledger.rank{rank}.jsonl", "w")
    per_step = micro * train_cfg["grad_accum"]
    epoch, cursor, tails = 0, 0, []
    schedule, tail = rank_schedule(len(rows), world, micro, train_cfg["tail"], train_cfg["seed"])
    tails.append({"epoch": 0, **tail})
    losses = []
    engine.train()
    for step in range(train_cfg["steps"]):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step_started = time.perf_counter()
        consumed, step_loss, tokens = [], 0.0, 0
        for _ in range(train_cfg["grad_accum"]):
            if cursor + micro > len(schedule[rank]):
                epoch, cursor = epoch + 1, 0
                schedule, tail = rank_schedule(len(rows), world, micro, train_cfg["tail"], train_cfg["seed"] + epoch)
                tails.append({"epoch": epoch, **tail})
            batch_rows = [rows[i] for i in schedule[rank][cursor:cursor + micro]]
            cursor += micro
            batch = {k: v.to(device) for k, v in collate(batch_rows, pad_id).items()}
            loss = supervised_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / train_cfg["grad_accum"]
            tokens += int(batch["attention_mask"].sum())
            consumed.extend(batch_rows)
            for row in batch_rows:
                ledger.write(json.dumps({"epoch": epoch, "step": step, "window_id": row["window_id"]}) + "\n")
        elapsed = time.perf_counter() - step_started
        losses.append(step_loss)
        entry = {
            "step": step, "rank": rank, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
            "grad_norm": _float(engine.get_global_grad_norm()),
            "samples": [r["window_id"] for r in consumed],
            "frames": [len(r["frame_indices"]) for r in consumed],
            "grid": [r["video_grid_thw"] for r in consumed],
            "input_tokens": [r["input_tokens"] for r in consumed],
            "supervised_tokens": [r["supervised_tokens"] for r in consumed],
            "step_seconds": elapsed, "tokens_per_second": tokens / elapsed, **peak_memory(device),
        }
        steps_log.write(json.dumps(entry) + "\n")
        steps_log.flush()
        if rank == 0:
            print(f"step {step}: loss {step_loss:.4f} lr {entry['lr']:.2e} grad norm {entry['grad_norm']} "
                  f"{elapsed:.2f} s", flush=True)
    steps_log.close()
    ledger.close()

    final_lora = gathered_lora_state(engine.module)
    unchanged = [name for name, value in final_lora.items() if torch.equal(value, initial_lora[name])]
    if train_cfg["steps"] >= 2 and unchanged:
        raise RuntimeError(f"{len(unchanged)} of {len(final_lora)} LoRA tensors did not change in "
                           f"{train_cfg['steps']} steps: {unchanged[:5]}")
    adapter_dir = out / "adapter"
    if rank == 0:
        save_adapter(engine.module, final_lora, adapter_dir)
    torch_dist.barrier()
    record["results"] = {
        "world_size": world, "device": str(device), "precision": precision, "load": load,
        "lora_targets": targets, "trainable_parameters": sum(v.numel() for v in final_lora.values()),
        "lora_tensors": len(final_lora), "lora_unchanged": unchanged,
        "steps": train_cfg["steps"], "losses_rank0": losses, "samples": len(rows), "tail": tails,
        "ledger": ledger_summary(out, world, rows),
        "zero_stage": ds_config["zero_optimization"]["stage"],
    }


def _pad_id(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def save_adapter(model, state: dict, adapter_dir: Path) -> None:
    """Save the adapter from gathered tensors; check shapes, finiteness and the file set."""
    import torch

    for name, tensor in state.items():
        parameter = dict(model.named_parameters())[name]
        if list(tensor.shape) != logical_shape(parameter) or tensor.numel() == 0:
            raise RuntimeError(f"LoRA tensor {name} gathered as {list(tensor.shape)}, expected {logical_shape(parameter)}")
        if not torch.isfinite(tensor).all():
            raise RuntimeError(f"LoRA tensor {name} has non-finite values")
    model.save_pretrained(adapter_dir, state_dict=state, safe_serialization=True)
    extra = sorted(set(os.listdir(adapter_dir)) - ADAPTER_FILES)
    if extra:
        raise RuntimeError(f"{adapter_dir} holds files other than the adapter: {extra}")


def ledger_summary(out: Path, world: int, rows: list[dict]) -> dict:
    consumed: dict[int, int] = {}
    for rank in range(world):
        path = out / f"ledger.rank{rank}.jsonl"
        consumed[rank] = sum(1 for _ in open(path)) if path.exists() else 0
    return {"consumed_per_rank": consumed, "train_samples": len(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--samples", type=Path, required=True, help="manifest.json from the preprocess stage")
    parser.add_argument("--probe", type=Path, required=True, help="probe.json from the probe stage")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "train")

    import deepspeed
    import torch

    torch.manual_seed(cfg["train"]["seed"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend=backend, timeout=dt.timedelta(seconds=cfg["train"]["timeout_s"]))
    rank = torch.distributed.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    with run_record("train", args.out, cfg, enabled=rank == 0, code=args.code) as record:
        train(cfg, args.samples, args.probe, args.out, record)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

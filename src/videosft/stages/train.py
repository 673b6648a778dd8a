"""Stage 4, train: LoRA fine-tuning under DeepSpeed ZeRO-3, one process per device.

    torchrun --nproc_per_node 2 -m videosft.stages.train --config config.yaml \\
        --samples results/preprocess/manifest.json --probe results/probe/probe.json --out results/train

The model is built inside ``deepspeed.zero.Init`` (partitioned as it is created, no full copy
per rank) and loaded from the checkpoint through the probe's key map, each rank writing its own
partition of each existing ``nn.Parameter`` straight from the file; every element is then compared
with the file, again by the rank that holds it.
The vision tower and merger stay frozen (their inputs and weights need no gradient, so they
build no autograd graph); LoRA goes on the language model's modules the probe reported. Before
training, fla's kernels (the Gated-DeltaNet, fused norms / SwiGLU / convolution) are checked
against transformers' forwards and bound, and ZeRO-3 is told to gather whole decoder layers and
vision blocks. Each rank holds the index of the train split (its small columns) and reads only its
own samples, each batch's rows when the batch is prepared, one batch ahead, so that its host memory
does not grow with the number of windows; every sample a rank consumes is written to its ledger.
The loss is computed from logits at the supervised positions only. The adapter is saved with
gathered, full-shape tensors and no base weights (:mod:`videosft.data.adapter`).
"""

from __future__ import annotations

import cProfile
import dataclasses
import datetime as dt
import gzip
import json
import math
import os
import random
import resource
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np

from ..kernels import attention_backends
from ..kernels import autotune
from .. import config as config_lib
from ..kernels import packed_attention
from ..data.adapter import gathered_lora_state, lora_parameters, save_adapter
from ..training.batches import BatchesAhead, host_positions, tokens_in
from ..encoding.chat import IGNORE_INDEX
from ..models.checkpoint import build_meta_model, load_checkpoint, model_class
from ..errors import ConfigError, InputError
from ..kernels.fused import select_fused_kernels
from ..kernels.gated_deltanet import select_gated_delta_rule
from ..models.lora import target_module_names
from ..training.memory import ModelFacts, SampleFacts, micro_batch, plan_peak
from ..media.pixels import load_video_processor
from ..progress import ProgressLine
from ..provenance import exit_after, path_fingerprint, run_record, stage_parser, write_json
from ..data.sample_store import SampleIndex, SampleReader, index_samples, sample_files
from ..training.sampling import Cursor, DataError, check_every_rank_has_a_batch, check_ledgers, check_pack_budget, epoch_plan, packed_epoch_plan
from ..kernels.vision_attention import batch_vision_attention

PROCESS_STARTED = time.time()  # torch, deepspeed and the kernels import after this

TENSORBOARD = "tensorboard"  # results/train/tensorboard/rank<r>: `tensorboard --logdir results/train/tensorboard`
SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's name for its CPU shared-memory collectives op


# ---------------------------------------------------------------- data


def load_samples(manifest: Path) -> SampleIndex:
    """The train split's index, in a fixed order (files of an unknown schema version are refused):
    each rank reads the frames of its own samples only, batch by batch (SampleReader)."""
    index = index_samples(manifest, "train")
    if not len(index):
        raise DataError(f"{manifest} lists no train samples")
    return index


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
        raise ConfigError(f"{path}: zero_optimization.stage must be 3")
    if ds["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
        raise ConfigError(f"{path}: offload_param to nvme is not supported (the loader writes each rank's partition "
                         "in place, in device or host memory); use \"device\": \"cpu\"")
    leftover = [key for key, value in ds.items() if value == "auto"]
    if leftover:
        raise ConfigError(f"{path}: no value for 'auto' keys {leftover}")
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


def add_lora(model, lora_cfg: dict, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    for parameter in model.parameters():
        parameter.requires_grad_(False)
    targets = target_module_names(model, lora_cfg["target_modules"])
    if not targets:
        raise ConfigError(f"lora.target_modules {lora_cfg['target_modules']} match no module of the language model")
    torch.manual_seed(seed)  # every rank initialises the same LoRA weights before ZeRO partitions them
    peft_config = LoraConfig(r=lora_cfg["r"], lora_alpha=lora_cfg["alpha"], lora_dropout=lora_cfg["dropout"],
                             target_modules=targets, bias="none")
    return get_peft_model(model, peft_config), targets


def enable_checkpointing(model, offload: bool, pin_memory: bool) -> None:
    """Gradient checkpointing of every decoder layer (non-reentrant). With ``offload``, the input each
    layer keeps for its recomputation waits in host memory instead (pinned on a GPU: the copies run
    asynchronously), and comes back when the backward pass reaches the layer.

    transformers' own ``offload=True`` always asks for pinned memory, which fails without a GPU; and
    a ``save_on_cpu`` around the whole model would also move every tensor saved outside the layers
    (the LM head's input and weight among them) on every step."""
    import functools

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = functools.partial(
                    _checkpoint_inputs_on_host, module._gradient_checkpointing_func, pin_memory)


def gather_whole_blocks(model) -> list[str]:
    """Mark the model's no-split blocks (decoder layers, vision blocks) as ZeRO-3 leaf modules.

    ZeRO-3 then fetches a block's weights in one gather when the block starts and releases them when
    it ends, instead of running its fetch / release hooks around every linear layer and norm inside
    it: on Qwen3.5-4B about 1,000 gathers of 5 MB and the hook work around each, three times a step
    (forward, recomputation, backward). Returns the block class names."""
    from deepspeed.utils import set_z3_leaf_modules

    wanted = set(getattr(model, "_no_split_modules", None) or [])
    classes = sorted({type(module) for module in model.modules() if type(module).__name__ in wanted},
                     key=lambda cls: cls.__name__)
    if not classes:
        raise ConfigError(f"train.gather_whole_blocks: {type(model).__name__} names no blocks to gather whole "
                         f"(_no_split_modules {sorted(wanted)}); set it to false for this model")
    set_z3_leaf_modules(model, classes)
    return [cls.__name__ for cls in classes]


def _checkpoint_inputs_on_host(checkpoint, pin_memory: bool, function, *args, **kwargs):
    from torch.autograd.graph import save_on_cpu

    # torch's non-reentrant checkpoint saves the layer's inputs as saved tensors outside its own
    # hooks, so these hooks take them; inside the layer the checkpoint's hooks save nothing.
    with save_on_cpu(pin_memory=pin_memory):
        return checkpoint(function, *args, **kwargs)


def supervised_loss(model, batch: dict):
    """Cross-entropy over the supervised positions only: the LM head never sees the rest.

    The mean over every supervised token of the micro-batch: each token weighs the same, in a padded
    batch as in a pack (``train.pack_tokens``), so a pack's loss is that of its samples as a padded
    batch, and a sample's tokens count as they would there."""
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


def token_losses(model, batch: dict, start: int = 0, end: int | None = None):
    """Per-token cross-entropy, without gradients, at the supervised targets among tokens [start, end) of
    the batch's first row: a packed sample's losses, to hold against the same sample's alone."""
    import torch

    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0].float()
    end = end or logits.shape[0]
    targets = batch["labels"][0, start + 1:end]
    chosen = targets != IGNORE_INDEX
    return torch.nn.functional.cross_entropy(logits[start:end - 1][chosen], targets[chosen], reduction="none")


def reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def start_profiler(device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def write_profile(profiler, device, path: Path, step: int, seconds: float) -> None:
    """The profiled step's operators, most self time on the device first (on CPU: on the host), and
    its timeline."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.stop()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70)
    path.write_text(f"step {step}: {seconds:.3f} s wall (profiled), operators by {key}\n{table}\n")
    # The table sums time; only the timeline shows where the device waited on the host.
    trace = path.with_suffix(".trace.json")
    profiler.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def write_python_profile(python, path: Path, step: int) -> None:
    """The main thread's Python functions in one step: when the device waits on the host, which
    code kept it waiting. Taken the step after the operator profile: cProfile slows Python-heavy
    code, which would distort that step's timeline."""
    import io
    import pstats

    python.disable()
    functions = io.StringIO()
    stats = pstats.Stats(python, stream=functions)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(50)  # the nested module wrappers take many rows each
    path.write_text(f"step {step}: the main thread's Python functions (cProfile; compare shares, not times)\n"
                    f"{functions.getvalue()}")


def lr_lambda(train_cfg: dict):
    warmup, steps = train_cfg["warmup_steps"], train_cfg["steps"]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    """What the phases of one training run share: its config, place in the world and the index of
    its samples."""
    cfg: dict
    out: Path
    rank: int
    world: int
    device: object
    precision: str
    probe: dict
    index: SampleIndex
    ds_config: dict

    @property
    def train_cfg(self) -> dict:
        return self.cfg["train"]

    @property
    def pack_tokens(self) -> int | None:
        """The tokens-per-micro-batch budget of packed batches, or None for padded ones."""
        return self.train_cfg["pack_tokens"] or None

    def plan_for(self, epoch: int):
        """The seeded order every rank reads its samples in, for one epoch."""
        train_cfg = self.train_cfg
        if self.pack_tokens:
            return packed_epoch_plan([entry.input_tokens for entry in self.index], self.world, self.pack_tokens,
                                     train_cfg["tail"], train_cfg["seed"], epoch, train_cfg["smoke"])
        return epoch_plan(len(self.index), self.world, train_cfg["micro_batch_size"], train_cfg["tail"],
                          train_cfg["seed"], epoch, train_cfg["smoke"])


@dataclasses.dataclass
class Built:
    """The DeepSpeed engine around the loaded, LoRA-wrapped model, and how it was built."""
    engine: object
    scheduler: object
    load: dict
    kernels: dict
    lora_targets: list
    leaf_blocks: list


@dataclasses.dataclass
class Progress:
    """What the steps leave for the results: peaks per step and the LoRA tensors that never moved."""
    peaks: list = dataclasses.field(default_factory=list)
    unchanged: list | None = None


def train(cfg: dict, samples_path: Path, probe_path: Path, out: Path, record: dict, resume: bool) -> None:
    """One training run, phase by phase: check and set up, build the engine, start or resume, the
    steps, then the adapter and the run's results."""
    run = prepare(cfg, samples_path, probe_path, out)
    built = build_engine(run)
    identity = run_identity(cfg, samples_path, run.world)
    cursor, first_step = start_or_resume(run, built.engine, resume, identity)
    progress = run_steps(run, built, cursor, first_step, identity)
    record["results"] = finish(run, built, progress, first_step if resume else None)


def prepare(cfg: dict, samples_path: Path, probe_path: Path, out: Path) -> Run:
    """The device and its memory cap, every config check that needs no model, the samples."""
    import torch
    import torch.distributed as torch_dist

    train_cfg = cfg["train"]
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    limit_gib = train_cfg["gpu_memory_gib"]
    if limit_gib and device.type == "cuda":  # behave like a smaller card (e.g. 12 GiB) on a larger one
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib * 2**30 / total), device)
    probe = json.loads(probe_path.read_text())
    if not probe.get("ok"):
        raise InputError(f"{probe_path} reports a checkpoint that does not fit; rerun the probe and fix it first")
    if train_cfg["profile_step"] is not None and train_cfg["profile_step"] >= train_cfg["steps"]:
        raise ConfigError(f"train.profile_step={train_cfg['profile_step']} is not one of the "
                          f"{train_cfg['steps']} steps (train.steps): nothing would be profiled")
    if train_cfg["gather_whole_blocks"] and not train_cfg["gradient_checkpointing"]:
        # DeepSpeed releases a leaf block's weights when its forward ends and, without a
        # recomputation to gather them again, its backward finds them partitioned
        raise ConfigError("train.gather_whole_blocks needs train.gradient_checkpointing: true; "
                          "set gather_whole_blocks: false to train without checkpointing")
    if train_cfg["offload_activations"] and not train_cfg["gradient_checkpointing"]:
        raise ConfigError("train.offload_activations moves the inputs that gradient checkpointing keeps; "
                          "it needs train.gradient_checkpointing: true")
    check_packing(train_cfg)
    index = load_samples(samples_path)
    check_every_rank_has_a_batch(len(index), world, train_cfg["micro_batch_size"], train_cfg["tail"],
                                 train_cfg["smoke"])
    if train_cfg["pack_tokens"]:
        check_pack_budget([entry.input_tokens for entry in index], index.window_ids(),
                          train_cfg["pack_tokens"])
    precision = choose_precision(train_cfg["precision"])
    ds_config = deepspeed_config(Path(train_cfg["deepspeed_config"]), train_cfg, world, precision)
    run = Run(cfg, out, rank, world, device, precision, probe, index, ds_config)
    run.plan_for(0)  # a packed schedule that would leave a rank idle fails here, on every rank alike
    return run


def check_packing(train_cfg: dict) -> None:
    """The options packed batches (train.pack_tokens) cannot work with."""
    if not train_cfg["pack_tokens"]:
        return
    if train_cfg["micro_batch_size"] != 1:
        raise ConfigError(f"train.pack_tokens={train_cfg['pack_tokens']} makes each micro-batch one pack of samples; "
                          f"set train.micro_batch_size: 1 (it is {train_cfg['micro_batch_size']}), or pack_tokens: null")
    if train_cfg["tail"] == "error":
        raise ConfigError("train.pack_tokens with train.tail: error: the number of packs changes from epoch to epoch, "
                          "so whether it divides into the ranks cannot be promised before training; set train.tail "
                          "to pad or drop (applied to whole packs)")


def build_engine(run: Run) -> Built:
    """The model partitioned as it is built, the checkpoint loaded and checked, the kernels bound
    (fla's only after they match the torch reference at this model's shapes), checkpointing,
    whole-block gathering, LoRA, and DeepSpeed around it all."""
    import deepspeed
    import torch

    train_cfg, model_dir = run.train_cfg, Path(run.cfg["model"]["path"])
    longest = run.pack_tokens or max(entry.input_tokens for entry in run.index)  # fla's kernels see a whole pack
    # The Gated-DeltaNet check binds a function of the modeling module and needs only the layers'
    # shapes: it runs on the meta-device model, before the weights take GPU memory (its fp32
    # reference took 3.1 GiB more at 64 frames, enough to break a 12 GiB card's plan).
    autotuned = autotune.apply(run.device)  # before the kernel checks, the first to run fla's kernels
    if run.rank == 0 and run.device.type == "cuda":
        autotune.save_when_stopped(*autotune_table(run))
    gated_deltanet = select_gated_delta_rule(build_meta_model(model_dir), run.device, longest)
    started = time.perf_counter()
    model, _hf_ds_config = build_partitioned_model(model_dir, run.ds_config)
    load = load_checkpoint(model, model_dir, run.probe["key_map"])
    load["build_and_load_seconds"] = time.perf_counter() - started
    kernels = {"gated_deltanet": gated_deltanet,
               "fused": select_fused_kernels(model, run.device, longest, train_cfg["fused_kernels"]),
               "vision_attention_batched": batch_vision_attention(model), "autotune": autotuned,
               "packed_attention": packed_attention.bind(model) if run.pack_tokens else None,
               "attention": attention_backends.for_batches(
                   run.device, padded=train_cfg["micro_batch_size"] > 1 and not run.pack_tokens)}
    if run.rank == 0:
        fused = {kind: impl for kind, impl in kernels["fused"]["implementation"].items() if impl}
        print(f"Gated-DeltaNet: {kernels['gated_deltanet']['implementation']}; fused kernels: {fused}", flush=True)
        if run.device.type == "cuda":
            print(autotune.summary(autotuned), flush=True)
    if train_cfg["gradient_checkpointing"]:
        enable_checkpointing(model, offload=train_cfg["offload_activations"], pin_memory=run.device.type == "cuda")
    leaf_blocks = gather_whole_blocks(model) if train_cfg["gather_whole_blocks"] else []
    model, targets = add_lora(model, run.cfg["lora"], train_cfg["seed"])
    trainable = [p for _, p in lora_parameters(model)]
    optimizer = torch.optim.AdamW(trainable, lr=train_cfg["lr"], weight_decay=train_cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train_cfg))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=run.ds_config,
        model_parameters=trainable, dist_init_required=False)
    return Built(engine, scheduler, load, kernels, targets, leaf_blocks)


def start_or_resume(run: Run, engine, resume: bool, identity: dict) -> tuple[Cursor, int]:
    """The data position and first step: a fresh start clears an earlier run's logs and
    checkpoints; a resumption continues from the last checkpoint, its logs trimmed to it."""
    import torch.distributed as torch_dist

    cursor, first_step = Cursor(), 0
    checkpoints = run.out / "checkpoints"
    if resume:
        cursor, first_step = resume_from(engine, checkpoints, run.rank, identity)
    elif run.rank == 0:  # a fresh run: logs, ledgers and checkpoints of an earlier run would mislead
        for stale in run.out.glob("*.rank*.jsonl"):
            stale.unlink()
        shutil.rmtree(checkpoints, ignore_errors=True)
        shutil.rmtree(run.out / TENSORBOARD, ignore_errors=True)
    torch_dist.barrier()
    trim_logs(run.out, run.rank, first_step)
    return cursor, first_step


def run_steps(run: Run, built: Built, cursor: Cursor, first_step: int, identity: dict) -> Progress:
    """The training steps: batches read and prepared a step ahead, every sample read written to the ledger,
    every step to the step log, LoRA's movement checked after the second, checkpoints saved."""
    train_cfg, engine, rank, index, device = run.train_cfg, built.engine, run.rank, run.index, run.device
    micro = train_cfg["micro_batch_size"]
    initial_lora = gathered_lora_state(engine.module)
    if first_step == 0:
        nonzero_b = [name for name, value in initial_lora.items() if "lora_B" in name and value.any()]
        if nonzero_b:
            raise RuntimeError(f"LoRA B matrices start non-zero: {nonzero_b[:3]}; the update check assumes B = 0")
    progress = Progress()
    shown = ProgressLine("train", train_cfg["steps"] - first_step, "steps")
    board = scalar_board(run.out, rank, first_step)
    steps_log = open(run.out / f"steps.rank{rank}.jsonl", "a")
    ledger = open(run.out / f"ledger.rank{rank}.jsonl", "a")
    engine.train()
    model_dir = Path(run.cfg["model"]["path"])
    reader = SampleReader(index)
    batches = BatchesAhead(reader.read, _pad_id(model_dir), load_video_processor(model_dir), device,
                           host_positions(engine.module), pack=bool(run.pack_tokens))
    for step in range(first_step, train_cfg["steps"]):
        reset_peak_memory(device)
        profiled = train_cfg["profile_step"]
        profiler = start_profiler(device) if step == profiled else None
        python_profile = cProfile.Profile() if profiled is not None and step == profiled + 1 else None
        if python_profile:
            python_profile.enable()
        step_started = time.perf_counter()
        consumed, step_loss, tokens = [], 0.0, 0
        for micro_step in range(train_cfg["grad_accum"]):
            epoch, indices = cursor.next_batch(run.plan_for, rank, micro)
            batch_entries = [index[i] for i in indices]
            require_video(batch_entries, rank)
            batch = batches.take(indices)
            last_batch = step + 1 == train_cfg["steps"] and micro_step + 1 == train_cfg["grad_accum"]
            if not last_batch:  # the schedule is fixed: peek at the next batch on a copy of the cursor
                _, upcoming = dataclasses.replace(cursor).next_batch(run.plan_for, rank, micro)
                batches.announce(upcoming)
            loss = supervised_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / train_cfg["grad_accum"]
            tokens += tokens_in(batch)
            consumed.extend(batch_entries)
            for position, entry in zip(indices, batch_entries):
                ledger.write(json.dumps({"epoch": epoch, "step": step, "index": position,
                                         "window_id": entry.window_id}) + "\n")
        ledger.flush()
        elapsed = time.perf_counter() - step_started
        if profiler:
            write_profile(profiler, device, run.out / f"profile.rank{rank}.txt", step, elapsed)
        if python_profile:
            write_python_profile(python_profile, run.out / f"profile.rank{rank}.python.txt", step)
        memory = peak_memory(device)
        progress.peaks.append(memory)
        entry = {
            "step": step, "rank": rank, "loss": step_loss, "lr": built.scheduler.get_last_lr()[0],
            "grad_norm": _float(engine.get_global_grad_norm()),
            "samples": [e.window_id for e in consumed],
            "frames": [e.frames for e in consumed],
            "grid": [list(e.grid) for e in consumed],
            "input_tokens": [e.input_tokens for e in consumed],
            "supervised_tokens": [e.supervised_tokens for e in consumed],
            "step_seconds": elapsed, "tokens_per_second": tokens / elapsed, **memory,
            "since_start_s": time.time() - PROCESS_STARTED,  # a first run's cost shows at step 0
        }
        steps_log.write(json.dumps(entry) + "\n")
        steps_log.flush()
        for key in ("loss", "lr", "grad_norm", "tokens_per_second", *memory):
            if entry[key] is not None:
                board.add_scalar(f"{'memory' if key in memory else 'train'}/{key}", entry[key], step)
        if step == first_step and rank == 0 and device.type == "cuda":
            save_autotune_choices(run, built)  # complete after one step; kept even if the run dies later
        if rank == 0:
            shown.advance(note=f"step {step}: loss {step_loss:.4f} lr {entry['lr']:.2e} grad norm "
                               f"{_shown_float(entry['grad_norm'])} {elapsed:.2f} s {entry['tokens_per_second']:.0f} tokens/s")
        if step == first_step + 1:
            # lora_B starts at zero, so lora_A gets no gradient on the first step by construction:
            # only after the second step must every LoRA tensor have moved.
            progress.unchanged = lora_unchanged(engine.module, initial_lora)
            if progress.unchanged and train_cfg["check_lora_updates"]:
                raise RuntimeError(f"{len(progress.unchanged)} of {len(initial_lora)} LoRA tensors did not change in "
                                   f"two steps: {progress.unchanged[:5]}; set train.check_lora_updates: false to go on "
                                   "anyway")
        if train_cfg["save_every"] and (step + 1) % train_cfg["save_every"] == 0 and step + 1 < train_cfg["steps"]:
            save_training_state(engine, run.out / "checkpoints", step, cursor, rank, identity)
    batches.close()
    reader.close()
    steps_log.close()
    ledger.close()
    board.close()
    return progress


def finish(run: Run, built: Built, progress: Progress, resumed_from_step: int | None) -> dict:
    """The adapter (rank 0, gathered from every rank), and the run's results: what was loaded and
    bound, the losses, the ledgers' proof that each epoch read every sample, memory against the plan."""
    import torch.distributed as torch_dist

    final_lora = gathered_lora_state(built.engine.module)
    if run.rank == 0:
        save_adapter(built.engine.module, final_lora, run.out / "adapter")
        if run.device.type == "cuda":
            save_autotune_choices(run, built)
    all_peaks = [None] * run.world
    torch_dist.all_gather_object(all_peaks, progress.peaks)
    torch_dist.barrier()
    train_cfg = run.train_cfg
    return {
        "world_size": run.world, "device": str(run.device), "precision": run.precision, "load": built.load,
        "kernels": built.kernels, "lora_targets": built.lora_targets,
        "trainable_parameters": sum(v.numel() for v in final_lora.values()), "lora_tensors": len(final_lora),
        "lora_unchanged_after_two_steps": progress.unchanged, "steps": train_cfg["steps"],
        "resumed_from_step": resumed_from_step,
        "losses_rank0": [json.loads(line)["loss"] for line in (run.out / "steps.rank0.jsonl").read_text().splitlines()],
        "samples": len(run.index),
        "ledger": check_ledgers(run.out, run.world, len(run.index), run.plan_for, run.index.window_ids(),
                                train_cfg["smoke"]),
        "zero_stage": run.ds_config["zero_optimization"]["stage"], "zero3_leaf_blocks": built.leaf_blocks,
        "memory": memory_comparison(run.probe, planned_batches(run), run.world, run.ds_config, run.precision, train_cfg,
                                    all_peaks, kernel_set(built.kernels)),
    }


def save_autotune_choices(run: Run, built: Built) -> None:
    """This GPU model's autotuning choices as a table a later run can restore (autotune.ENV)."""
    built.kernels["autotune"]["saved_kernels"] = autotune.save(*autotune_table(run))


def autotune_table(run: Run) -> tuple[Path, str, str]:
    """Where this run's autotune table goes, for which GPU model, written by which command."""
    return run.out / "autotune.json", autotune.gpu_model(run.device), " ".join(sys.argv)


def _shown_float(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def kernel_set(kernels: dict) -> str:
    """The memory planner's name for the kernels this run bound (videosft.training.memory.COEFFICIENTS)."""
    if kernels["gated_deltanet"]["implementation"] == "torch":
        return "torch"
    if "fla" in kernels["fused"]["implementation"].values():
        return "fla"
    return "fla-unfused" if kernels["gated_deltanet"]["implementation"] == "fla" else "torch"


def require_video(entries: list, rank: int) -> None:
    """Every rank runs the vision tower on every step: under ZeRO-3 a rank that skips it hangs the rest."""
    for entry in entries:
        if not entry.visual_tokens or not entry.frames:
            raise DataError(f"rank {rank}: sample {entry.window_id} has no video; every batch must carry one")


def lora_unchanged(model, initial: dict) -> list[str]:
    current = gathered_lora_state(model)
    return [name for name, value in current.items() if value.equal(initial[name])]


def planned_batches(run: Run) -> list:
    """What the memory plan is sized by: the samples, or with packing each pack of the first epoch,
    as one sample of all its tokens and frames."""
    if not run.pack_tokens:
        return list(run.index)
    return [types.SimpleNamespace(**{key: sum(getattr(run.index[i], key) for i in pack) for key in
                                     ("input_tokens", "visual_tokens", "supervised_tokens", "frames")})
            for packs in run.plan_for(0).packs for pack in packs]


def memory_comparison(probe: dict, index: list, world: int, ds_config: dict, precision: str,
                      train_cfg: dict, peaks: list[list[dict]], kernels: str | None = None) -> dict:
    """The planner's prediction for this run beside each rank's measured peak."""
    facts = probe.get("memory", {}) and probe["memory"].get("model_facts")
    measured = {rank: {key: max(step[key] for step in steps) for key in steps[0]} if steps else {}
                for rank, steps in enumerate(peaks)}
    if not facts:
        return {"measured": measured}
    longest = max(index, key=lambda entry: entry.input_tokens)
    # ``index`` holds whole packs when packing (planned_batches); padded micro-batches are sized here
    sample = micro_batch(SampleFacts(longest.input_tokens, longest.visual_tokens, longest.supervised_tokens,
                                     longest.frames), train_cfg["micro_batch_size"])
    trainable = probe["lora"]["trainable_parameters"]
    predicted = plan_peak(ModelFacts(**facts), sample, trainable, world, ds_config["zero_optimization"], precision,
                          checkpointing=train_cfg["gradient_checkpointing"], kernels=kernels,
                          offload_activations=train_cfg["offload_activations"],
                          whole_blocks=train_cfg["gather_whole_blocks"])
    return {"predicted": predicted, "measured": measured}


def save_training_state(engine, checkpoints: Path, step: int, cursor: Cursor, rank: int, identity: dict) -> None:
    """LoRA weights, optimizer, scheduler (DeepSpeed's checkpoint), then each rank's data position and
    RNG states, and only then ``latest``: a kill at any moment leaves the previous checkpoint the one
    to resume from, whole. Every file is written atomically."""
    import torch.distributed as torch_dist

    tag = f"step-{step + 1}"
    engine.save_checkpoint(str(checkpoints), tag=tag, client_state={"next_step": step + 1}, save_latest=False)
    write_json(checkpoints / tag / f"position.rank{rank}.json", {"cursor": dataclasses.asdict(cursor),
                                                                 "rng": rng_state()})
    torch_dist.barrier()
    if rank == 0:
        write_json(checkpoints / tag / "identity.json", identity)
        tmp = checkpoints / ".latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, checkpoints / "latest")
    torch_dist.barrier()


def resume_from(engine, checkpoints: Path, rank: int, identity: dict) -> tuple[Cursor, int]:
    latest = checkpoints / "latest"
    if not latest.exists():
        raise InputError(f"--resume: no checkpoint in {checkpoints} (train.save_every saves them)")
    tag = latest.read_text().strip()
    check_identity(json.loads((checkpoints / tag / "identity.json").read_text()), identity, checkpoints / tag)
    _, client = engine.load_checkpoint(str(checkpoints), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    position = json.loads((checkpoints / tag / f"position.rank{rank}.json").read_text())
    set_rng_state(position["rng"])
    print(f"rank {rank}: resuming at step {client['next_step']} from {checkpoints / tag}", flush=True)
    return Cursor(**position["cursor"]), client["next_step"]


IDENTITY = {"config_sha256": "configuration (model, lora, train sections)",
            "samples": "sample store (the manifest and its train files)", "world_size": "world size"}


def check_identity(saved: dict, identity: dict, checkpoint: Path) -> None:
    """Refuse to resume a checkpoint made with another config, sample store or world size, naming which."""
    changed = [IDENTITY[key] for key in identity if saved.get(key) != identity[key]]
    if changed:
        raise InputError(f"checkpoint {checkpoint} was made with another {' and another '.join(changed)}; "
                         "resume with what it was made with, or start afresh (without --resume)")


def run_identity(cfg: dict, samples_path: Path, world: int) -> dict:
    """What must not change between a run and its resumption: the config (all but the resume
    switch), the samples (manifest and train files, by size and modification time) and the world
    size, whose change would replay another data order from the saved position."""
    from ..provenance import config_hash

    samples = [Path(samples_path), *sample_files(samples_path, "train")]
    return {"config_sha256": config_hash({**cfg, "train": {k: v for k, v in cfg["train"].items() if k != "resume"}}),
            "samples": [path_fingerprint(path) for path in samples], "world_size": world}


def rng_state() -> dict:
    """Every RNG's state as JSON: resumption never unpickles anything."""
    import torch

    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), position, has_gauss, cached],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def scalar_board(out: Path, rank: int, first_step: int):
    """This rank's TensorBoard event files: loss, learning rate, gradient norm, tokens/s and peak memory per step.
    On resume, ``purge_step`` hides the earlier run's points from the checkpoint's step on (they run again)."""
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(out / TENSORBOARD / f"rank{rank}"), purge_step=first_step or None, flush_secs=10)


def trim_logs(out: Path, rank: int, first_step: int) -> None:
    """On resume, forget log and ledger lines of steps after the checkpoint (they will run again)."""
    for name in (f"steps.rank{rank}.jsonl", f"ledger.rank{rank}.jsonl"):
        path = out / name
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < first_step]
            path.write_text("".join(line + "\n" for line in kept))


def _pad_id(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--samples", type=Path, required=True, help="manifest.json from the preprocess stage")
    parser.add_argument("--probe", type=Path, required=True, help="probe.json from the probe stage")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints "
                        "(also set by train.resume)")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "train")

    # Before the first CUDA allocation. A long clip allocates and frees blocks of many sizes (layer
    # inputs coming back from the host, offloaded weights); segments that grow keep the cache from
    # fragmenting (bench/RESULTS.md). A value set by the user wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import deepspeed
    import torch

    torch.manual_seed(cfg["train"]["seed"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        # On CPU, DeepSpeed compiles a shared-memory C++ op on first use (30 s, minutes on a loaded
        # machine) that only its tensor-parallel inference all-reduce calls; training needs gloo alone.
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    deepspeed.init_distributed(dist_backend=backend, timeout=dt.timedelta(seconds=cfg["train"]["timeout_s"]))
    rank = torch.distributed.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    with run_record("train", args.out, cfg, args, enabled=rank == 0) as record:
        train(cfg, args.samples, args.probe, args.out, record, resume=args.resume or cfg["train"]["resume"])
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_after(main, hard=True)

"""Stage 4, train: LoRA fine-tuning under DeepSpeed ZeRO-3 (one rank: without ZeRO), one process per device.

    torchrun --nproc_per_node 2 -m videosft.stages.train --config config.yaml \\
        --samples results/preprocess/manifest.json --probe results/probe/probe.json --out results/train

The phases: :func:`prepare` (device, config checks, the samples' index), :func:`build_engine` (the
model partitioned as it is built and loaded through the probe's key map, every element compared
with the file; fla's kernels checked against transformers' forwards and bound; checkpointing,
whole-block gathering, LoRA on the language model, the vision tower frozen), :func:`start_or_resume`,
:func:`run_steps` (each rank reads only its own samples, a batch ahead, and writes each to its
ledger; the loss from logits at supervised positions only) and :func:`finish` (the adapter, gathered
to full-shape tensors, and the run's results). Their parts live in :mod:`videosft.training`,
:mod:`videosft.kernels` and :mod:`videosft.data`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..data import train_logs
from ..data.adapter import gathered_lora_state, lora_parameters, save_adapter
from ..data.probe_result import read_probe
from ..data.sample_store import SampleIndex, SampleReader, index_samples
from ..kernels import autotune, selection, ulysses
from ..media.pixels import load_video_processor
from ..models.checkpoint import build_meta_model, load_checkpoint, pad_token_id
from ..progress import ProgressLine
from ..provenance import existing_path, exit_after, run_record, stage_parser
from ..training import setup
from ..training.batches import BatchesAhead, host_positions
from ..training.memory import PlanOptions, kernel_set, memory_comparison, planned_batches
from ..training.profiling import StepProfiles, peak_memory, reset_peak_memory
from ..training.resume import resume_from, run_identity, save_training_state
from ..training.sequence_shards import SequenceGroup, sequence_group
from ..training.sampling import Cursor, DataError, check_every_rank_has_a_batch, check_ledgers, check_pack_budget, \
    epoch_plan, packed_epoch_plan
from ..training.steps import LoraWatch, progress_note, step_entry, train_step

PROCESS_STARTED = time.time()  # torch, deepspeed and the kernels import after this


@dataclasses.dataclass
class Run:
    """What the phases of one training run share: its config, place in the world and the index of
    its samples."""
    cfg: View
    out: Path
    rank: int
    world: int
    device: object
    precision: str
    probe: dict
    index: SampleIndex
    ds_config: dict
    sequence: SequenceGroup | None = None  # train.sequence_parallel's group of this rank, if any

    @property
    def train_cfg(self) -> View:
        return self.cfg.train

    @property
    def data_world(self) -> int:  # the data-parallel ranks: n ranks of a sequence-parallel group read as one
        return self.world // self.train_cfg.sequence_parallel

    @property
    def pack_tokens(self) -> int | None:
        """The tokens-per-micro-batch budget of packed batches, or None for padded ones."""
        return self.train_cfg.pack_tokens or None

    def plan_for(self, epoch: int):
        """The seeded order every rank reads its samples in, for one epoch."""
        t = self.train_cfg
        if self.pack_tokens:
            return packed_epoch_plan([entry.input_tokens for entry in self.index], self.data_world, self.pack_tokens,
                                     t.tail, t.seed, epoch, t.smoke)
        return epoch_plan(len(self.index), self.data_world, t.micro_batch_size, t.tail, t.seed, epoch, t.smoke)

    def next_batch(self, cursor: Cursor) -> tuple[int, list[int]]:
        return cursor.next_batch(self.plan_for, self.rank // self.train_cfg.sequence_parallel, self.train_cfg.micro_batch_size)

    def autotune_table(self) -> tuple[Path, str, str] | None:
        """Where rank 0 keeps this GPU model's autotuning choices, and the command that made them."""
        if self.rank != 0 or self.device.type != "cuda":
            return None
        return self.out / "autotune.json", autotune.gpu_model(self.device), " ".join(sys.argv)

    def save_autotune(self, kernels: dict) -> None:
        """Keep this GPU model's autotuning choices as a table a later run can restore (autotune.ENV)."""
        if self.autotune_table():
            kernels["autotune"]["saved_kernels"] = autotune.save(*self.autotune_table())


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
    decode_processes: int = 0  # per rank; 0: the batch thread decoded the frames


def train(cfg: View, samples_path: Path, probe_path: Path, out: Path, record: dict, resume: bool) -> None:
    """One training run, phase by phase: check and set up, build the engine, start or resume, the
    steps, then the adapter and the run's results."""
    run = prepare(cfg, samples_path, probe_path, out)
    built = build_engine(run)
    identity = run_identity(cfg, samples_path, run.world)
    cursor, first_step = start_or_resume(run, built.engine, resume, identity)
    progress = run_steps(run, built, cursor, first_step, identity)
    record["results"] = finish(run, built, progress, first_step if resume else None)


def prepare(cfg: View, samples_path: Path, probe_path: Path, out: Path) -> Run:
    """The device and its memory cap, every config check that needs no model, the samples."""
    import torch
    import torch.distributed as torch_dist

    train_cfg = cfg.train
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    setup.cap_device_memory(train_cfg.memory_cap_gib, device)  # e.g. a 12 GiB card on a larger one
    probe = read_probe(probe_path)
    setup.check_train_options(train_cfg)
    index = index_samples(samples_path, "train")  # each rank reads only its own samples' frames, batch by batch
    if not len(index):
        raise DataError(f"{samples_path} lists no train samples")
    sequence = sequence_group(Path(cfg.model.path), train_cfg, world)  # before any check that needs the data world
    check_every_rank_has_a_batch(len(index), world // train_cfg.sequence_parallel, train_cfg.micro_batch_size,
                                 train_cfg.tail, train_cfg.smoke)
    if train_cfg.pack_tokens:
        check_pack_budget([entry.input_tokens for entry in index], index.window_ids(), train_cfg.pack_tokens)
    precision = setup.choose_precision(train_cfg.precision)
    ds_config = setup.deepspeed_config(Path(train_cfg.deepspeed_config), train_cfg, world, precision,
                                       torch.distributed.get_backend())
    run = Run(cfg, out, rank, world, device, precision, probe, index, ds_config, sequence)
    run.plan_for(0)  # a packed schedule that would leave a rank idle fails here, on every rank alike
    return run


def build_engine(run: Run) -> Built:
    """The model partitioned as it is built, the checkpoint loaded and checked, the kernels bound
    (fla's only after they match the torch reference at this model's shapes), checkpointing,
    whole-block gathering, LoRA, and DeepSpeed around it all."""
    import deepspeed

    train_cfg, model_dir = run.train_cfg, Path(run.cfg.model.path)
    longest = run.pack_tokens or max(entry.input_tokens for entry in run.index)  # fla's kernels see a whole pack
    chosen = selection.before_build(build_meta_model(model_dir), run.device, longest, run.autotune_table())
    started = time.perf_counter()
    model, _keep_alive = setup.build_model(model_dir, run.ds_config, run.device, run.precision)
    load = load_checkpoint(model, model_dir, run.probe["key_map"])
    load["build_and_load_seconds"] = time.perf_counter() - started
    kernels = selection.bind(model, chosen, run.device, longest, train_cfg.fused_kernels, packed=bool(run.pack_tokens),
                             padded=train_cfg.micro_batch_size > 1 and not run.pack_tokens)
    if run.rank == 0:
        print("\n".join(selection.summary(kernels, run.device)), flush=True)
    if train_cfg.gradient_checkpointing:
        setup.enable_checkpointing(model, offload=train_cfg.offload_activations, pin_memory=run.device.type == "cuda",
                                   uncheckpointed_layers=train_cfg.uncheckpointed_layers)
    leaf_blocks = setup.gather_whole_blocks(model, run.ds_config) if train_cfg.gather_whole_blocks else []
    model, targets = setup.add_lora(model, run.cfg.lora, train_cfg.seed)
    if run.sequence:
        kernels["sequence_parallel"] = {"size": run.sequence.n, **ulysses.bind(model)}
    trainable = [p for _, p in lora_parameters(model)]
    optimizer, scheduler = setup.optimizer_and_schedule(trainable, train_cfg, run.ds_config)
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
        train_logs.clear(run.out)
        shutil.rmtree(checkpoints, ignore_errors=True)
    torch_dist.barrier()
    train_logs.trim(run.out, run.rank, first_step)
    return cursor, first_step


def run_steps(run: Run, built: Built, cursor: Cursor, first_step: int, identity: dict) -> Progress:
    """The training steps: batches read and prepared a step ahead, every sample read written to the ledger,
    every step to the step log, LoRA's movement checked after the second, checkpoints saved."""
    train_cfg, engine, rank, device = run.train_cfg, built.engine, run.rank, run.device
    shown = ProgressLine("train", train_cfg.steps - first_step, "steps")
    logs = train_logs.RankLogs(run.out, rank, first_step)
    profiles = StepProfiles(train_cfg.profile_step, device, run.out, rank)
    engine.train()
    model_dir = Path(run.cfg.model.path)
    reader = SampleReader(run.index)
    batches = BatchesAhead(reader.read, pad_token_id(model_dir), load_video_processor(model_dir), device,
                           host_positions(engine.module), pack=bool(run.pack_tokens),
                           shard=run.sequence.shard if run.sequence else None,
                           decode_processes=train_cfg.decode_processes)
    watch, progress = LoraWatch(engine.module, fresh=first_step == 0), Progress(decode_processes=batches.decode_processes)
    for step in range(first_step, train_cfg.steps):
        reset_peak_memory(device)
        with profiles.step(step) as timed:
            done = train_step(engine, batches, cursor, run.next_batch, run.index, rank, train_cfg.grad_accum,
                              last_step=step + 1 == train_cfg.steps,
                              record_read=lambda epoch, i, entry: logs.read(epoch, step, i, entry.window_id),
                              sequence=run.sequence)
        memory = peak_memory(device)
        progress.peaks.append(memory)
        entry = step_entry(step, rank, done, engine, built.scheduler, timed.seconds, memory,
                           time.time() - PROCESS_STARTED)
        logs.step(entry, memory_keys=tuple(memory))
        if step == first_step:
            run.save_autotune(built.kernels)  # complete after one step; kept even if the run dies later
        if rank == 0:
            shown.advance(note=progress_note(entry))
        if step == first_step + 1:
            progress.unchanged = watch.check(engine.module, required=train_cfg.check_lora_updates)
        if train_cfg.save_every and (step + 1) % train_cfg.save_every == 0 and step + 1 < train_cfg.steps:
            save_training_state(engine, run.out / "checkpoints", step, cursor, rank, identity)
    for opened in (batches, reader, logs):
        opened.close()
    return progress


def finish(run: Run, built: Built, progress: Progress, resumed_from_step: int | None) -> dict:
    """The adapter (rank 0, gathered from every rank), and the run's results: what was loaded and
    bound, the losses, the ledgers' proof that each epoch read every sample, memory against the plan."""
    import torch.distributed as torch_dist

    final_lora = gathered_lora_state(built.engine.module)
    if run.rank == 0:
        save_adapter(built.engine.module, final_lora, run.out / "adapter")
        run.save_autotune(built.kernels)
    all_peaks = [None] * run.world
    torch_dist.all_gather_object(all_peaks, progress.peaks)
    torch_dist.barrier()
    if run.rank == 0:  # after the barrier every rank's step log is complete
        train_logs.write_all_steps(run.out)
    train_cfg = run.train_cfg
    options = PlanOptions.of(train_cfg, precision=run.precision, kernels=kernel_set(built.kernels))
    return {
        "world_size": run.world, "device": str(run.device), "precision": run.precision, "load": built.load,
        "kernels": built.kernels, "lora_targets": built.lora_targets,
        "trainable_parameters": sum(v.numel() for v in final_lora.values()), "lora_tensors": len(final_lora),
        "lora_unchanged_after_two_steps": progress.unchanged, "steps": train_cfg.steps,
        "resumed_from_step": resumed_from_step,
        "losses_rank0": [entry["loss"] for entry in train_logs.read_steps(run.out).get(0, [])],
        "samples": len(run.index),
        "ledger": check_ledgers(run.out, run.world, len(run.index), run.plan_for, run.index.window_ids(),
                                train_cfg.smoke, train_cfg.sequence_parallel),
        "sequence_parallel": train_cfg.sequence_parallel, "decode_processes_per_rank": progress.decode_processes,
        "zero_stage": run.ds_config["zero_optimization"]["stage"], "zero3_leaf_blocks": built.leaf_blocks,
        "memory": memory_comparison(run.probe, planned_batches(run.index, run.pack_tokens and run.plan_for(0)),
                                    run.world, run.ds_config["zero_optimization"], options, all_peaks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--samples", type=existing_path, required=True, help="manifest.json from the preprocess stage")
    parser.add_argument("--probe", type=existing_path, required=True, help="probe.json from the probe stage")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT/checkpoints "
                        "(also set by train.resume)")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "train")

    rank = setup.init_distributed(cfg.train.seed, cfg.train.timeout_s)
    args.out.mkdir(parents=True, exist_ok=True)
    with run_record("train", args.out, cfg, args, enabled=rank == 0) as record:
        train(cfg, args.samples, args.probe, args.out, record, resume=args.resume or cfg.train.resume)
    setup.end_distributed()
    return 0


if __name__ == "__main__":
    exit_after(main, hard=True)

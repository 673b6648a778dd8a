"""Resumable training state: saved so that a kill at any moment leaves a whole checkpoint, refused when
the run it would continue is not the run that saved it, and restored to give the same adapter bit
for bit.

Our part of the state (data positions, RNG states, what the run was made with) is JSON, never
unpickled; the LoRA, optimizer and scheduler states are DeepSpeed's own checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
from pathlib import Path

import numpy as np

from ..config import View, plain
from ..data.sample_store import sample_files
from ..errors import InputError
from ..provenance import config_hash, path_fingerprint, write_json
from .sampling import Cursor

LATEST = "latest"  # names the checkpoint to resume from; written last
IDENTITY = {"config_sha256": "configuration (model, lora, train sections)",
            "samples": "sample store (the manifest and its train files)", "world_size": "world size"}


def save_training_state(engine, checkpoints: Path, step: int, cursor: Cursor, rank: int, identity: dict) -> None:
    """LoRA weights, optimizer, scheduler (DeepSpeed's checkpoint), then each rank's data position and
    RNG states, and only then ``latest``: a kill at any moment leaves the previous checkpoint the one
    to resume from, whole. Every file is written atomically."""
    import torch.distributed as torch_dist

    tag = f"step-{step + 1}"
    with trainable_state_only(engine.module) if saves_trainable_only(engine) else contextlib.nullcontext():
        engine.save_checkpoint(str(checkpoints), tag=tag, client_state={"next_step": step + 1}, save_latest=False)
    write_json(checkpoints / tag / f"position.rank{rank}.json", {"cursor": dataclasses.asdict(cursor),
                                                                 "rng": rng_state()})
    torch_dist.barrier()
    if rank == 0:
        write_json(checkpoints / tag / "identity.json", identity)
        tmp = checkpoints / f".{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, checkpoints / LATEST)
    torch_dist.barrier()


def resume_from(engine, checkpoints: Path, rank: int, identity: dict) -> tuple[Cursor, int]:
    """The data position and the next step of the last whole checkpoint, its states loaded."""
    latest = checkpoints / LATEST
    if not latest.exists():
        raise InputError(f"--resume: no checkpoint in {checkpoints} (train.save_every saves them)")
    tag = latest.read_text().strip()
    check_identity(json.loads((checkpoints / tag / "identity.json").read_text()), identity, checkpoints / tag)
    _, client = engine.load_checkpoint(str(checkpoints), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True, load_module_strict=not saves_trainable_only(engine))
    position = json.loads((checkpoints / tag / f"position.rank{rank}.json").read_text())
    set_rng_state(position["rng"])
    print(f"rank {rank}: resuming at step {client['next_step']} from {checkpoints / tag}", flush=True)
    return Cursor(**position["cursor"]), client["next_step"]


def saves_trainable_only(engine) -> bool:
    """Without ZeRO, DeepSpeed's checkpoint would hold the whole frozen model (8 GiB for Qwen3.5-4B in bf16)
    beside the adapters; the model is loaded from its own files on resumption, so it keeps only what trains."""
    return engine.zero_optimization_stage() == 0


@contextlib.contextmanager
def trainable_state_only(model):
    """``model.state_dict()`` without the frozen parameters while inside. DeepSpeed's own
    ``exclude_frozen_parameters`` drops them by their first names only, so a tied one (the LM head of
    Qwen3.5-4B: its embedding, 1.2 GiB in bf16) would stay under its other name."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def drop_frozen(module, state_dict, prefix, local_metadata):
        for name in frozen:
            state_dict.pop(prefix + name, None)

    handle = model.register_state_dict_post_hook(drop_frozen)
    try:
        yield
    finally:
        handle.remove()


def check_identity(saved: dict, identity: dict, checkpoint: Path) -> None:
    """Refuse to resume a checkpoint made with another config, sample store or world size, naming which."""
    changed = [IDENTITY[key] for key in identity if saved.get(key) != identity[key]]
    if changed:
        raise InputError(f"checkpoint {checkpoint} was made with another {' and another '.join(changed)}; "
                         "resume with what it was made with, or start afresh (without --resume)")


def run_identity(cfg: View, samples_path: Path, world: int) -> dict:
    """What must not change between a run and its resumption: the config (all but the resume
    switch), the samples (manifest and train files, by size and modification time) and the world
    size, whose change would replay another data order from the saved position."""
    samples = [Path(samples_path), *sample_files(samples_path, "train")]
    return {"config_sha256": config_hash(plain(cfg.replace(train=cfg.train.replace(resume=False)))),
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

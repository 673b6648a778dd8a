"""The LoRA adapter a fine-tune produces: its file set, gathering its tensors, saving and listing it.

The train stage gathers the LoRA tensors from every ZeRO-3 rank (:func:`gathered_lora_state`) and
saves them (:func:`save_adapter`); the verify stage lists the directory it reads
(:func:`adapter_files`) and compares every tensor of :data:`ADAPTER_WEIGHTS`. One definition of
what an adapter directory holds (:data:`ADAPTER_FILES`), so the writer and the checker agree.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import InputError
from ..models.checkpoint import logical_shape

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = {ADAPTER_WEIGHTS, "adapter_config.json", "README.md"}
WORKFLOW_MARKERS = {".snakemake_timestamp"}  # Snakemake stamps directory outputs with this


def lora_parameters(model) -> list[tuple[str, object]]:
    return [(name, p) for name, p in model.named_parameters() if "lora_" in name]


def gathered_lora_state(model) -> dict:
    """Full-shape copies of every LoRA tensor (a collective: every rank must call it)."""
    import deepspeed

    named = lora_parameters(model)
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {name: p.data.detach().cpu().clone() for name, p in named}


def save_adapter(model, state: dict, adapter_dir: Path) -> None:
    """Save the adapter from gathered tensors; check shapes, finiteness and the file set.

    Written to a scratch directory first and renamed into place, so an interrupted save never
    leaves a half adapter that looks complete.
    """
    import torch

    parameters = dict(model.named_parameters())
    for name, tensor in state.items():
        if list(tensor.shape) != logical_shape(parameters[name]) or tensor.numel() == 0:
            raise RuntimeError(f"LoRA tensor {name} gathered as {list(tensor.shape)}, "
                               f"expected {logical_shape(parameters[name])}")
        if not torch.isfinite(tensor).all():
            raise RuntimeError(f"LoRA tensor {name} has non-finite values")
    scratch = adapter_dir.with_name(f".{adapter_dir.name}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch, state_dict=state, safe_serialization=True)
    extra = sorted(set(os.listdir(scratch)) - ADAPTER_FILES)
    if extra:
        raise RuntimeError(f"{adapter_dir} would hold files other than the adapter: {extra}")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    scratch.rename(adapter_dir)


def check_readable(adapter_dir: Path) -> None:
    """Refuse, naming the file, an adapter whose weights are missing or cut short (a full disk, a copy
    stopped half way), before a base model is loaded for it."""
    from safetensors import SafetensorError, safe_open

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise InputError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}; point to the adapter directory the train stage wrote")
    try:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                handle.get_slice(key)
    except (SafetensorError, OSError) as error:
        raise InputError(f"{path}: not a readable safetensors file ({error}); it is damaged or was cut short. "
                         "Run the train stage again (snakemake --forcerun train) or copy the adapter again") from None


def adapter_files(adapter_dir: Path) -> dict:
    """The adapter directory's files and sizes, and any that are not adapter files."""
    files = {path.name: path.stat().st_size for path in adapter_dir.iterdir() if path.name not in WORKFLOW_MARKERS}
    extra = sorted(set(files) - ADAPTER_FILES)
    return {"files": files, "bytes": sum(files.values()), "unexpected_files": extra}

"""``probe.json``: what the probe stage found of the checkpoint and, given the samples, planned.

The probe stage writes it (:func:`write_probe`), only for a checkpoint that fits the model: the
checkpoint's tensors against the model's (``checkpoint_tensors``, ``mapped``, ``renamed``, ``missing``,
``unexpected``, ``shape_mismatch``, ...), ``key_map`` (each checkpoint key's shard and parameter,
which the train stage loads through), ``lora`` (the modules LoRA wraps and its
``trainable_parameters``), ``ok`` and ``problems``, and ``memory``, the memory plan for the longest
sample (None without samples): ``gpu_memory_gib``, the card it plans for, the predicted peaks
``per_world_size``, the ``model_facts`` behind them and the ``flowchart``. Its run record holds the
same without the key map (:func:`recorded`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..provenance import write_json
from .records import number, read_json

PROBE_JSON = "probe.json"


def write_probe(out_dir: Path, result: dict) -> None:
    write_json(out_dir / PROBE_JSON, result)


def recorded(result: dict) -> dict:
    """The results the run record keeps: all but the key map, one entry per checkpoint tensor."""
    return {key: value for key, value in result.items() if key != "key_map"}


def read_probe(path: Path) -> dict:
    """Everything the probe wrote, the key map included; refused where it found a checkpoint that does not fit."""
    probe = read_json(path)
    if not probe.get("ok"):
        raise InputError(f"{path} reports a checkpoint that does not fit; rerun the probe and fix it first")
    return probe


def read_planned_gpu_memory(path: Path) -> float | None:
    """The GPU memory (GiB) the probe's memory plan was made for; None where it made no plan."""
    return number((read_json(path).get("memory") or {}).get("gpu_memory_gib"))


def read_sequence_plan(path: Path) -> dict[int, dict]:
    """n -> the plan for one micro-batch shared by n GPUs (``train.sequence_parallel``): its
    ``reserved_gib`` per GPU and ``largest_frames_under_limit``; empty where the probe made no plan."""
    plan = (read_json(path).get("memory") or {}).get("per_sequence_parallel_size") or {}
    return {int(n): {"reserved_gib": number(peak.get("reserved_gib")),
                     "largest_frames_under_limit": peak.get("largest_frames_under_limit")} for n, peak in plan.items()}

"""The train stage's results, as its run record (``results/train/run_record.json``) holds them
under ``results``.

The train stage returns them from its last phase: ``world_size``, ``device`` and ``precision`` of
the run; ``load``, the checkpoint load (``entries``, ``matched``, a ``summary`` and its times in
seconds: :data:`LOAD_TIMES`); ``memory``, each rank's ``measured`` peaks in GiB over the run
(:data:`PEAKS`, by rank) and, where the probe made a memory plan, the ``predicted`` ones
(``allocated_gib``, ``reserved_gib``, ...); ``kernels``, the kernels bound, with ``warnings`` for a
slow path taken unasked; LoRA's targets, rank 0's losses and the ledgers' check. What each step did is in :mod:`videosft.data.train_logs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .records import numbers, read_json

LOAD_TIMES = ("build_and_load_seconds", "load_seconds", "verify_seconds")
PEAKS = ("peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib")  # accelerator, or the process on CPU
PREDICTED = ("allocated_gib", "reserved_gib")


@dataclass(frozen=True)
class TrainResults:
    """What a training run recorded; None or empty where it recorded nothing."""

    world_size: int | None = None
    device: str | None = None  # "cpu", "cuda:0", ...
    precision: str | None = None
    load_seconds: dict[str, float] = field(default_factory=dict)  # of LOAD_TIMES, those recorded
    load_summary: str | None = None
    predicted_gib: dict[str, float] = field(default_factory=dict)  # of PREDICTED; empty without a plan
    measured_gib: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> its PEAKS
    kernel_warnings: list[str] = field(default_factory=list)  # a slow path the run took unasked


def read_train_results(record_path: Path) -> TrainResults:
    results = read_json(record_path).get("results") or {}
    load, memory = results.get("load") or {}, results.get("memory") or {}
    return TrainResults(
        world_size=results.get("world_size"), device=results.get("device"), precision=results.get("precision"),
        load_seconds=numbers(load, LOAD_TIMES), load_summary=load.get("summary"),
        predicted_gib=numbers(memory.get("predicted") or {}, PREDICTED),
        measured_gib={int(rank): numbers(peaks, PEAKS) for rank, peaks in (memory.get("measured") or {}).items()},
        kernel_warnings=list((results.get("kernels") or {}).get("warnings") or []))

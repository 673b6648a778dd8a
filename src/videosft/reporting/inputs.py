"""Where the report's inputs are, and reading them: each file through the reader of the module that
owns it; one that is not given, not found or empty is :class:`Missing`, and its figure a
placeholder that says why."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..data.predict_summary import PredictSummary, read_predict_summary
from ..data.probe_result import read_planned_gpu_memory, read_sequence_plan
from ..data.rejects import read_rejects
from ..data.sample_store import read_manifest
from ..data.train_logs import read_all_steps
from ..data.train_results import TrainResults, read_train_results
from ..data.verify_result import VerifyResult, read_verify
from ..data.windows import read_windows

T = TypeVar("T")


class Missing(Exception):
    """An input the figure needs is absent or empty: draw a placeholder that says so."""


@dataclass
class Inputs:
    """Where the other stages' outputs are; any of them may be absent."""

    windows: Path | None = None
    window_rejects: Path | None = None
    manifest: Path | None = None
    preprocess_rejects: Path | None = None
    probe: Path | None = None
    train: Path | None = None  # the train stage's run_record.json
    train_steps: Path | None = None  # the train stage's steps.jsonl: every rank's step log
    verify: Path | None = None
    predict: Path | None = None  # the predict stage's summary.json: scored in source time for the val split

    @classmethod
    def under(cls, results: Path) -> "Inputs":
        """The default layout of the workflow's ``results/`` directory."""
        results = Path(results)
        return cls(
            windows=results / "window" / "windows.parquet",
            window_rejects=results / "window" / "rejects.jsonl",
            manifest=results / "preprocess" / "manifest.json",
            preprocess_rejects=results / "preprocess" / "rejects.jsonl",
            probe=results / "probe" / "probe.json",
            train=results / "train" / "run_record.json",
            train_steps=results / "train" / "steps.jsonl",
            verify=results / "verify" / "verify.json",
            predict=results / "predict" / "summary.json",
        )

    def described(self) -> dict[str, dict[str, Any]]:
        return {name: {"path": None if path is None else str(path), "exists": path is not None and Path(path).exists()}
                for name, path in vars(self).items()}


def read_input(reader: Callable[[Path], T], path: Path | None, what: str, empty_is_missing: bool = True) -> T:
    """``reader(path)``, or Missing saying why there is nothing to read."""
    if path is None:
        raise Missing(f"{what}: not given")
    path = Path(path)
    if not path.exists():
        raise Missing(f"{what}: {path} not found")
    if empty_is_missing and not path.stat().st_size:
        raise Missing(f"{what}: {path} is empty")
    return reader(path)


def optional(reading: Callable[[], T], default: Any = None) -> tuple[T | Any, str | None]:
    """Call ``reading``; a Missing input gives ``default`` and the reason."""
    try:
        return reading(), None
    except Missing as missing:
        return default, str(missing)


def windows(inputs: Inputs) -> list[dict]:
    return read_input(read_windows, inputs.windows, "windows")


def rejects(path: Path | None, stage: str) -> list[dict]:
    """The items a stage rejected; an empty file is a stage that rejected nothing."""
    return read_input(read_rejects, path, f"{stage} rejects", empty_is_missing=False)


def manifest(inputs: Inputs) -> dict:
    return read_input(read_manifest, inputs.manifest, "preprocess manifest")


def planned_gpu_memory(inputs: Inputs) -> float | None:
    return read_input(read_planned_gpu_memory, inputs.probe, "probe")


def sequence_plan(inputs: Inputs) -> dict[int, dict]:
    """n -> the probe's plan for one micro-batch shared by n GPUs."""
    return read_input(read_sequence_plan, inputs.probe, "probe")


def train_results(inputs: Inputs) -> TrainResults:
    return read_input(read_train_results, inputs.train, "train run record")


def step_logs(inputs: Inputs) -> dict[int, list[dict]]:
    """Rank -> its step entries."""
    logs = read_input(read_all_steps, inputs.train_steps, "train step logs")
    if not any(logs.values()):
        raise Missing(f"train step logs: no step entries in {inputs.train_steps}")
    return logs


def verify_result(inputs: Inputs) -> VerifyResult:
    return read_input(read_verify, inputs.verify, "verify")


def predict_summary(inputs: Inputs) -> PredictSummary:
    return read_input(read_predict_summary, inputs.predict, "predict summary")

"""``verify.json``: the verify stage's check of the adapter and its evaluation on val windows.

The verify stage writes it (:func:`write_verify`), only for an adapter that passed: ``adapter`` (its
files), ``tensors`` (each adapter tensor against the loaded model), ``forward`` (merged against
unmerged logits), ``load_seconds`` (the base model and the adapter, without DeepSpeed),
``gpu_peak_gib``, ``warnings`` (a slow path the answers took: a GPU without
flash-linear-attention), ``ok``, ``problems`` and ``evaluation``
(:func:`videosft.evaluation.answers.evaluate`: how many ``windows``, the ``base`` and ``fine_tuned``
scores per metric, the constant answers' ``baselines``, the fine-tune's per-window
``gain_over_best_constant`` with its standard error, and the ``answers`` per window).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..provenance import write_json
from .records import number, read_json

VERIFY_JSON = "verify.json"
# The keys of a score (``base``, ``fine_tuned``) that count windows rather than score them.
COUNTS = ("moment_windows", "empty_windows", "num_samples")


@dataclass(frozen=True)
class WindowEvaluation:
    """Base against fine-tuned on the same val windows, in window-local time."""

    windows: int | None
    metrics: list[tuple[str, float | None, float | None]]  # (metric, base, fine-tuned) with a value; no counts
    answers: list[dict]  # window_id, target (ranges to keep), and the base and fine_tuned answers' text
    gain: dict | None = None  # gain_over_best_constant: constant, mean, standard_error, windows


@dataclass(frozen=True)
class VerifyResult:
    load_seconds: float | None
    evaluation: WindowEvaluation | None  # None where verify evaluated nothing


def write_verify(out_dir: Path, result: dict) -> None:
    write_json(out_dir / VERIFY_JSON, result)


def read_verify(path: Path) -> VerifyResult:
    result = read_json(path)
    evaluation = result.get("evaluation")
    return VerifyResult(number(result.get("load_seconds")), window_evaluation(evaluation) if evaluation else None)


def window_evaluation(evaluation: dict) -> WindowEvaluation:
    base, tuned = evaluation.get("base") or {}, evaluation.get("fine_tuned") or {}
    names = [k for k in base if k not in COUNTS] + [k for k in tuned if k not in base and k not in COUNTS]
    metrics = [(name, number(base.get(name)), number(tuned.get(name))) for name in names]
    return WindowEvaluation(windows=evaluation.get("windows", base.get("num_samples")),
                            metrics=[row for row in metrics if row[1] is not None or row[2] is not None],
                            answers=evaluation.get("answers") or [], gain=evaluation.get("gain_over_best_constant"))

"""``summary.json`` of the predict stage: what it cut and, for the val split, how its cut lists score.

The predict stage writes its run's results there: ``source`` (``val`` or the folder of videos),
``model``, ``adapter`` (None for a merged model), ``min_agreement``, ``videos`` (asked for),
``predicted`` (cut), ``windows``, ``rejects``, ``outputs`` (per video its cut list's files),
``seconds``, and for the val split ``evaluation``: the merged cut lists scored against the
annotations in source time (:func:`videosft.evaluation.metrics.source_time_metrics`; also in
``evaluation.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..evaluation.metrics import SOURCE_TIME_DEFINITIONS
from .records import number, read_json


@dataclass(frozen=True)
class PredictSummary:
    source: str | None
    model: str | None
    adapter: str | None
    min_agreement: float | None
    videos: int | None
    predicted: int | None
    # the scores, then the counts behind them, in the order of SOURCE_TIME_DEFINITIONS (None where
    # nothing counts); None where there was nothing to score (videos without annotations)
    evaluation: dict[str, float | None] | None


def read_predict_summary(path: Path) -> PredictSummary:
    summary = read_json(path)
    evaluation = summary.get("evaluation")
    return PredictSummary(
        source=summary.get("source"), model=summary.get("model"), adapter=summary.get("adapter"),
        min_agreement=summary.get("min_agreement"), videos=summary.get("videos"), predicted=summary.get("predicted"),
        evaluation={name: number(evaluation[name]) for name in SOURCE_TIME_DEFINITIONS if name in evaluation}
        if evaluation else None)

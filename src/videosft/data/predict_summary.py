"""``summary.json`` of the predict stage: what it cut and, for the val split, how its cut lists score.

The predict stage writes its run's results there: ``source`` (``val`` or the folder of videos),
``model``, ``adapter`` (None for a merged model), ``min_agreement``, ``videos`` (asked for),
``predicted`` (cut), ``windows``, ``rejects``, ``skipped`` (each video left without a cut list: ``video``,
``shown`` (its name in the closing lines), ``code`` and ``reason`` in words), ``max_skipped``,
``outputs`` (per video its cut list's files),
``seconds``, and for the val split ``evaluation``: the merged cut lists scored against the
annotations in source time (:func:`videosft.evaluation.metrics.source_time_metrics`; also in
``evaluation.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .records import number, read_json


@dataclass(frozen=True)
class PredictSummary:
    source: str | None
    model: str | None
    adapter: str | None
    min_agreement: float | None
    videos: int | None
    predicted: int | None
    # the scores, then the counts behind them, as the predict stage wrote them (None where nothing
    # counts); None where there was nothing to score (videos without annotations)
    evaluation: dict[str, float | None] | None


def read_predict_summary(path: Path) -> PredictSummary:
    summary = read_json(path)
    evaluation = summary.get("evaluation")
    return PredictSummary(
        source=summary.get("source"), model=summary.get("model"), adapter=summary.get("adapter"),
        min_agreement=summary.get("min_agreement"), videos=summary.get("videos"), predicted=summary.get("predicted"),
        evaluation={name: number(value) for name, value in evaluation.items()}
        if evaluation else None)


def read_keep(path: Path) -> dict:
    """A ``keep.json`` of the predict stage, perhaps with its ``ranges`` corrected by hand: checked so that
    a mistake is named (file, range, what is wrong) before any timeline is written. Each range is
    ``[start, end]`` in the source's seconds on the player's clock, inside the video, in order."""
    from fractions import Fraction

    import json

    try:
        keep = read_json(path)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not JSON at line {error.lineno}, column {error.colno} ({error.msg}); "
                         "fix the edit there") from None
    missing = [key for key in ("video", "duration", "clock", "ranges") if not isinstance(keep, dict) or key not in keep]
    if missing:
        raise InputError(f"{path}: no {', '.join(missing)}; a keep.json as the predict stage writes it has them")
    try:
        Fraction(keep["clock"]["rate"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise InputError(f"{path}: clock.rate {keep['clock'].get('rate') if isinstance(keep['clock'], dict) else None!r}"
                         " is not a rate such as '30000/1001'; keep the clock predict wrote") from None
    previous = 0.0
    for index, pair in enumerate(keep["ranges"]):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, (int, float)) for x in pair)):
            raise InputError(f"{path}: ranges[{index}] is {pair!r}; each range is [start, end] in seconds")
        start, end = pair
        if not previous <= start < end <= keep["duration"] + 1e-6:
            raise InputError(f"{path}: ranges[{index}] [{start}, {end}] must start after the previous range ends "
                             f"({previous}) and end after it starts, inside the video (0 to {keep['duration']} s)")
        previous = end
    if not Path(keep["video"]).is_file():
        raise InputError(f"{path}: video {keep['video']} does not exist; the timelines point at it (move it back, "
                         "or write its path into the file)")
    return keep

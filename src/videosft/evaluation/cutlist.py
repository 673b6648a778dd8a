"""From window answers to the cut list an editor opens: ranges in source time, merged across
overlapping windows (the files themselves: :mod:`videosft.media.editor_timelines`).

**The merge rule.** Each window that answered in the format votes on the time it covers: keep
where its answer keeps, cut elsewhere. A moment of the video is kept when at least
``min_agreement`` of the windows that cover it and answered say keep (with the default 0.5 and
two overlapping windows, one is enough; with three, two are). Windows whose answer did not parse
abstain; a moment that only such windows cover is cut. The rule is applied exactly, on the
elementary intervals between all window and range boundaries, not on a time grid.

The cut lists of annotated videos are scored in source time (:func:`evaluate_in_source_time`).
"""

from __future__ import annotations

from ..media.timeline import Range, merge_ranges
from .metrics import source_time_metrics


def to_source(local: list[Range], window_start: float, window_end: float) -> list[Range]:
    """Window-local ranges in source seconds, clipped to the window."""
    ranges = []
    for start, end in local:
        start, end = window_start + start, min(window_start + end, window_end)
        if end > start:
            ranges.append((start, end))
    return ranges


def merge_votes(windows: list[dict], min_agreement: float) -> list[Range]:
    """Source-time ranges to keep from ``windows`` ({"start", "end", "ranges": source ranges, or
    None for an answer that did not parse}), by the rule in the module docstring."""
    voters = [w for w in windows if w["ranges"] is not None]
    points = sorted({t for w in voters for t in (w["start"], w["end"], *(x for r in w["ranges"] for x in r))})
    kept: list[list[float]] = []
    for left, right in zip(points, points[1:]):
        middle = (left + right) / 2
        covering = [w for w in voters if w["start"] <= middle < w["end"]]
        keeping = [w for w in covering if any(s <= middle < e for s, e in w["ranges"])]
        if keeping and len(keeping) >= min_agreement * len(covering):
            if kept and kept[-1][1] == left:
                kept[-1][1] = right
            else:
                kept.append([left, right])
    return [(start, end) for start, end in kept]


def evaluate_in_source_time(results: list[dict]) -> dict:
    """The merged source-time ranges against what the annotations keep, per video and query: the
    window stage's keep ranges of the val windows, joined back into source time (so fragments it
    dropped as shorter than window.min_fragment are not asked for). ``results``: the predict
    stage's per video and query (``name``, ``ranges``, ``source_windows``)."""
    predicted = {r["name"]: r["ranges"] for r in results}
    targets = {r["name"]: merge_ranges([tuple(x) for w in r["source_windows"] for x in w["keep_source"]])[0]
               for r in results}
    return source_time_metrics(predicted, targets)

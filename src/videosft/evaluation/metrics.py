"""Temporal-grounding (moment retrieval) metrics.

Two users share the same arithmetic:

* ``qvhighlights_moment_retrieval`` scores a QVHighlights-format submission so that our numbers
  can be put next to published ones: it follows the definitions of the official QVHighlights /
  Moment-DETR standalone evaluation, down to the details that move the second decimal
  (rounded thresholds, top-10 truncation before ranking, tie order, per-query averaging).
* ``window_metrics`` scores our own pipeline, whose answers are ranges in window-local seconds
  without scores, and whose targets may be empty ("nothing to keep" in this window).

Intervals are ``(start, end)`` in seconds; extra items (such as a score) are ignored where only
the interval matters. Pure Python: no third-party dependency.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The official thresholds are np.linspace(0.5, 0.95, 10) rounded to two decimals; rounding
# matters because an IoU of exactly 0.6 must pass the 0.6 threshold (linspace gives 0.6000...01).
QVHIGHLIGHTS_IOU_THRESHOLDS: tuple[float, ...] = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
WINDOW_R1_THRESHOLDS: tuple[float, ...] = (0.3, 0.5, 0.7)

# Ground-truth moment length buckets of the official evaluation, as (min, max] in seconds.
# A query belongs to a bucket when at least one of its GT windows does, and is then scored
# against those windows only (its predictions are kept whole).
QVHIGHLIGHTS_LENGTH_BUCKETS: dict[str, tuple[float, float]] = {
    "short": (0.0, 10.0),
    "middle": (10.0, 30.0),
    "long": (30.0, 150.0),
}

Interval = Sequence[float]


def temporal_iou(a: Interval, b: Interval) -> float:
    """Intersection over union of two time intervals, in [0, 1].

    An interval whose end is not after its start has no length, so it overlaps nothing and
    scores 0 (this covers malformed model answers without raising). Two such intervals also
    score 0 rather than dividing by zero, as in the official evaluation.
    """
    a_start, a_end = float(a[0]), float(a[1])
    b_start, b_end = float(b[0]), float(b[1])
    a_len = max(0.0, a_end - a_start)
    b_len = max(0.0, b_end - b_start)
    intersection = max(0.0, min(a_end, b_end) - max(a_start, b_start))
    if a_len == 0.0 or b_len == 0.0:
        return 0.0
    return intersection / (a_len + b_len - intersection)


def best_iou(window: Interval, targets: Iterable[Interval]) -> float:
    """IoU with the best-matching target: a query with several GT moments is answered by any."""
    return max((temporal_iou(window, t) for t in targets), default=0.0)


def r1_iou(window: Interval, targets: Sequence[Interval]) -> float:
    """The top-1 IoU exactly as the official QVHighlights evaluation computes R1 (``compute_mr_r1``):
    the target with the highest IoU (the first of equals) is chosen, then scored against the
    window over their hull, max end - min start, in that float order (the official paired IoU,
    which lmms-eval's temporal-grounding tasks also use). Where the two overlap the hull is the
    union, but float rounding differs: [1.6, 44.8] against [0, 48] gives 0.8999999999999999 here,
    and so officially, where the union gives 0.9; thresholds are decided on the official value."""
    if not targets:
        return 0.0
    ious = [temporal_iou(window, t) for t in targets]
    target = targets[ious.index(max(ious))]
    start, end = float(window[0]), float(window[1])
    t_start, t_end = float(target[0]), float(target[1])
    intersection = max(0.0, min(end, t_end) - max(start, t_start))
    hull = max(end, t_end) - min(start, t_start)
    return intersection / hull if hull != 0 else 0.0


def average_precision(ranked_windows: Sequence[Interval], targets: Sequence[Interval], threshold: float) -> float:
    """ActivityNet-style detection AP of one ranked list of windows, in [0, 1].

    Each prediction, best-ranked first, claims the unclaimed target it overlaps most (IoU >=
    ``threshold``); otherwise it is a false positive, so duplicates of one hit do not count
    twice. AP is the area under the interpolated (monotone envelope) precision-recall curve.
    Ties in IoU go to the later target, matching the official code's reversed argsort.
    """
    if not targets or not ranked_windows:
        return 0.0
    claimed = [False] * len(targets)
    hit_ranks: list[int] = []  # 1-based ranks of true positives
    for rank, window in enumerate(ranked_windows, start=1):
        ious = [temporal_iou(window, t) for t in targets]
        for j in sorted(range(len(targets)), key=lambda k: (ious[k], k), reverse=True):
            if ious[j] < threshold:
                break
            if not claimed[j]:
                claimed[j] = True
                hit_ranks.append(rank)
                break
    precision_at_hits = [(i + 1) / rank for i, rank in enumerate(hit_ranks)]
    # Interpolated precision at a recall level is the best precision at that recall or beyond;
    # recall only rises at hits, each by 1 / len(targets).
    area, envelope = 0.0, 0.0
    for precision in reversed(precision_at_hits):
        envelope = max(envelope, precision)
        area += envelope
    return area / len(targets)


def recall_at_1(
    predictions: Mapping[Any, Sequence[Interval]],
    ground_truth: Mapping[Any, Sequence[Interval]],
    thresholds: Iterable[float] = QVHIGHLIGHTS_IOU_THRESHOLDS,
) -> dict[float, float]:
    """Percent of queries whose top-1 window reaches IoU >= threshold with any GT window.

    ``predictions`` maps a query id to its windows, best first; the first one is the top-1 as
    submitted (the official evaluation does not re-sort for R1). Queries are those of
    ``predictions``, as officially; each must have ground truth (KeyError otherwise). Returns
    unrounded percentages keyed by threshold.
    """
    thresholds = list(thresholds)
    top1_ious = [r1_iou(windows[0], ground_truth[qid]) if windows else 0.0 for qid, windows in predictions.items()]
    if not top1_ious:
        raise ValueError("no queries to evaluate")
    return {t: 100.0 * sum(iou >= t for iou in top1_ious) / len(top1_ious) for t in thresholds}


def rank_by_score(windows: Sequence[Sequence[float]], max_predictions: int | None = 10) -> list[Sequence[float]]:
    """Keep the first ``max_predictions`` windows as submitted, then order them by score.

    Truncation comes first because the official evaluation does so (submissions are meant to be
    sorted already); the sort is stable, so equal scores keep their submitted order.
    """
    kept = list(windows) if max_predictions is None else list(windows)[:max_predictions]
    return sorted(kept, key=lambda w: -float(w[2]))


def mean_average_precision(
    predictions: Mapping[Any, Sequence[Sequence[float]]],
    ground_truth: Mapping[Any, Sequence[Interval]],
    thresholds: Iterable[float] = QVHIGHLIGHTS_IOU_THRESHOLDS,
    max_predictions: int | None = 10,
) -> dict[float | str, float]:
    """Per-query AP averaged over queries, in percent, per threshold, plus their ``'average'``.

    ``predictions`` maps a query id to ``(start, end, score)`` windows; see ``rank_by_score``.
    Averaging per query (not pooling all detections) is what QVHighlights does, so a query with
    many GT moments weighs as much as one with a single moment. Values are unrounded; the
    average is taken over unrounded per-threshold values, as officially.
    """
    thresholds = list(thresholds)
    if not predictions:
        raise ValueError("no queries to evaluate")
    totals = dict.fromkeys(thresholds, 0.0)
    for qid, windows in predictions.items():
        ranked = rank_by_score(windows, max_predictions)
        for t in thresholds:
            totals[t] += average_precision(ranked, ground_truth[qid], t)
    result: dict[float | str, float] = {t: 100.0 * totals[t] / len(predictions) for t in thresholds}
    result["average"] = sum(result[t] for t in thresholds) / len(thresholds)
    return result


def _threshold_key(threshold: float) -> str:
    """The official JSON keys: '0.5', '0.55', ... (str of the two-decimal float)."""
    return str(round(threshold, 2))


def _rounded(values: Mapping[Any, float]) -> dict[str, float]:
    return {(k if isinstance(k, str) else _threshold_key(k)): round(v, 2) for k, v in values.items()}


def _restrict_to_length(ground_truth: Mapping[Any, Sequence[Interval]], low: float, high: float) -> dict:
    """GT windows with low < length <= high, dropping queries left with none."""
    kept = {}
    for qid, windows in ground_truth.items():
        in_range = [w for w in windows if low < float(w[1]) - float(w[0]) <= high]
        if in_range:
            kept[qid] = in_range
    return kept


def qvhighlights_moment_retrieval(pred_rows: Iterable[Mapping], gt_rows: Iterable[Mapping]) -> dict:
    """Moment-retrieval metrics of a QVHighlights submission, keyed as the official output.

    ``pred_rows`` have ``qid`` and ``pred_relevant_windows`` ([start, end, score], sorted by
    score); ``gt_rows`` have ``qid`` and ``relevant_windows``. Returns ``brief`` (the
    ``MR-*`` entries only; highlight detection is not covered) and, for ``full``, ``short``,
    ``middle`` and ``long``, ``{"MR-mAP": {threshold: %, "average": %}, "MR-R1": {threshold: %}}``
    rounded to 2 decimals. A bucket with no query is left out.
    """
    predictions = {row["qid"]: row["pred_relevant_windows"] for row in pred_rows}
    ground_truth = {row["qid"]: row["relevant_windows"] for row in gt_rows}
    subsets = {"full": ground_truth}
    for name, (low, high) in QVHIGHLIGHTS_LENGTH_BUCKETS.items():
        subsets[name] = _restrict_to_length(ground_truth, low, high)

    result: dict[str, Any] = {"brief": {}}
    for name, subset_gt in subsets.items():
        subset_preds = {qid: windows for qid, windows in predictions.items() if qid in subset_gt}
        if not subset_preds:
            continue
        result[name] = {
            "MR-mAP": _rounded(mean_average_precision(subset_preds, subset_gt)),
            "MR-R1": _rounded(recall_at_1(subset_preds, subset_gt)),
        }

    full = result["full"]
    result["brief"] = {
        "MR-full-R1@0.5": full["MR-R1"]["0.5"],
        "MR-full-R1@0.7": full["MR-R1"]["0.7"],
        "MR-full-mAP": full["MR-mAP"]["average"],
        "MR-full-mAP@0.5": full["MR-mAP"]["0.5"],
        "MR-full-mAP@0.75": full["MR-mAP"]["0.75"],
    }
    for name in ("long", "middle", "short"):
        if name in result:
            result["brief"][f"MR-{name}-mAP"] = result[name]["MR-mAP"]["average"]
    return result


def window_metrics(samples: Iterable[Mapping], max_predictions: int | None = 10) -> dict[str, float]:
    """Grounding quality of our model on windows, each metric a fraction in [0, 1] (not percent).

    Each sample is ``{"predicted": [(start, end), ...] or None, "target": [(start, end), ...]}``
    in window-local seconds. Predicted ranges count as ranked in the order given (the first is
    the top-1); only the first ``max_predictions`` are scored for mAP.

    Over the windows that have something to keep (``moment_windows`` of them), averaged:

    * ``R1@0.3``, ``R1@0.5``, ``R1@0.7``: 1 if the first predicted range reaches IoU >= t with a
      target range, the IoU as the official evaluation computes it (:func:`r1_iou`).
    * ``mIoU``: that IoU, averaged.
    * ``mAP``: detection AP (see ``average_precision``) averaged over IoU 0.5:0.05:0.95.

    An unparseable answer (``predicted is None``) or an empty one scores 0 there. Windows with
    nothing to keep cannot be judged by IoU, and would reward always answering "none" if they
    were; they are scored apart (``empty_windows`` of them):

    * ``empty_accuracy``: the fraction answered with nothing to keep (``[]``);
    * ``false_keep_rate``: the fraction answered with ranges to keep (an editor would keep footage
      that should go); unparseable answers are neither.

    A metric over no windows is None. The result also carries ``num_samples``. Raises ValueError
    when there are no samples.
    """
    names = [f"R1@{t}" for t in WINDOW_R1_THRESHOLDS] + ["mIoU", "mAP"]
    totals = dict.fromkeys(names, 0.0)
    count = moments = empty = empty_right = false_keeps = 0
    for sample in samples:
        count += 1
        predicted, target = sample["predicted"], list(sample["target"])
        if not target:
            empty += 1
            empty_right += predicted == [] or predicted == ()
            false_keeps += bool(predicted)
            continue
        moments += 1
        if not predicted:
            continue
        predicted = list(predicted)
        top1 = r1_iou(predicted[0], target)
        for t in WINDOW_R1_THRESHOLDS:
            totals[f"R1@{t}"] += float(top1 >= t)
        totals["mIoU"] += top1
        ranked = predicted if max_predictions is None else predicted[:max_predictions]
        aps = [average_precision(ranked, target, t) for t in QVHIGHLIGHTS_IOU_THRESHOLDS]
        totals["mAP"] += sum(aps) / len(aps)
    if count == 0:
        raise ValueError("no samples to evaluate")
    result: dict = {name: total / moments if moments else None for name, total in totals.items()}
    result.update(moment_windows=moments, empty_windows=empty,
                  empty_accuracy=empty_right / empty if empty else None,
                  false_keep_rate=false_keeps / empty if empty else None, num_samples=count)
    return result


# What each key of window_metrics measures, in words a report puts beside the number.
WINDOW_METRIC_DEFINITIONS = {
    **{f"R1@{t}": f"share of the windows with something to keep whose first answered range reaches IoU >= {t} "
                  "with a range to keep (window-local seconds, the official R1 IoU)" for t in WINDOW_R1_THRESHOLDS},
    "mIoU": "IoU (as for R1) of the first answered range with a range to keep, averaged over the windows with "
            "something to keep (0 where the answer has no range or is not in the format)",
    "mAP": "average precision of the answered ranges in their order, averaged over IoU 0.5:0.05:0.95 and over the "
           "windows with something to keep",
    "empty_accuracy": "share of the windows with nothing to keep answered with nothing (none)",
    "false_keep_rate": "share of the windows with nothing to keep answered with ranges: footage an editor would keep "
                       "that should go (lower is better)",
}


def _overlap(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Seconds covered by both of two lists of disjoint ranges."""
    return sum(max(0.0, min(x[1], y[1]) - max(x[0], y[0])) for x in a for y in b)


def source_time_metrics(predicted: Mapping[Any, Sequence[Interval]],
                        targets: Mapping[Any, Sequence[Interval]]) -> dict:
    """A cut list scored against what should be kept, in source seconds, over several videos.

    Each predicted list and each target list holds disjoint ranges. Per target moment, its IoU with
    the best-matching predicted range (the official R1 IoU, :func:`r1_iou`): ``R1@t`` is the
    fraction of moments reaching t, ``mIoU`` their mean. And what an editor sees: ``keep_precision``,
    the share of the kept seconds that should be kept, and ``keep_recall``, the share of the seconds
    to keep that were kept, over all videos. Fractions in [0, 1]; None where nothing counts.
    """
    ious, kept, wanted, both = [], 0.0, 0.0, 0.0
    for key, target in targets.items():
        mine = list(predicted.get(key) or [])
        ious += [r1_iou(moment, mine) for moment in target]
        kept += sum(e - s for s, e in mine)
        wanted += sum(e - s for s, e in target)
        both += _overlap(mine, target)
    result: dict = {f"R1@{t}": (sum(iou >= t for iou in ious) / len(ious) if ious else None)
                    for t in WINDOW_R1_THRESHOLDS}
    result.update(mIoU=sum(ious) / len(ious) if ious else None, keep_precision=both / kept if kept else None,
                  keep_recall=both / wanted if wanted else None, videos=len(targets), moments=len(ious),
                  kept_seconds=kept, target_seconds=wanted)
    return result


# What each key of source_time_metrics measures, in words a report puts beside the number.
SOURCE_TIME_DEFINITIONS = {
    **{f"R1@{t}": f"share of the moments to keep (annotated ranges, source seconds) that the best-matching range "
                  f"of the cut list overlaps with IoU >= {t} (the official R1 IoU)" for t in WINDOW_R1_THRESHOLDS},
    "mIoU": "IoU (as for R1) of each moment to keep with its best-matching kept range, averaged over the moments "
            "(0 where nothing kept overlaps it)",
    "keep_precision": "seconds kept that should be kept / seconds kept, over all videos: how much of the cut is "
                      "wanted footage",
    "keep_recall": "seconds kept that should be kept / seconds that should be kept, over all videos: how much of "
                   "the wanted footage the cut holds",
    "videos": "videos scored (one cut list per video and query)",
    "moments": "ranges to keep in their annotations",
    "kept_seconds": "seconds the cut lists keep",
    "target_seconds": "seconds that should be kept",
}


def score_text(value) -> str:
    """A score as a one-line summary shows it: three decimals, "-" where nothing counted (None)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def source_time_headline(evaluation: dict) -> str:
    """A :func:`source_time_metrics` result in one line (each score as :data:`SOURCE_TIME_DEFINITIONS` defines
    it; "-" where nothing counts)."""
    def value(key: str) -> str:
        return score_text(evaluation.get(key))

    videos, moments = evaluation["videos"], evaluation["moments"]
    return (f"in source time, against the annotations of {videos} video{'s' * (videos != 1)} ({moments} "
            f"moment{'s' * (moments != 1)} to keep): R1@0.5 {value('R1@0.5')}, mIoU {value('mIoU')}, keep precision "
            f"{value('keep_precision')}, keep recall {value('keep_recall')}")


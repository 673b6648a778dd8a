"""The evaluation: per window, base against fine-tuned (the verify stage), and, where the predict
stage scored its merged cut lists of the val videos, in source time; read once for the chart
drawn here and the tables (:mod:`.tables`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.verify_result import WindowEvaluation
from ..evaluation.metrics import WINDOW_R1_THRESHOLDS
from . import inputs as read
from .drawing import axis_note, label_bars, new_figure, save
from .inputs import Inputs, Missing, optional

LOWER_IS_BETTER = {"unparseable_rate", "degenerate_rate", "false_keep_rate", "lenient_false_keep_rate"}
SOURCE_TIME_SCORES = [f"R1@{t}" for t in WINDOW_R1_THRESHOLDS] + ["mIoU", "keep_precision", "keep_recall"]
SOURCE_TIME_COUNTS = ["videos", "moments", "kept_seconds", "target_seconds"]
NOT_IN_THIS_REPORT = ("not part of this report: the workflow adds it with report.source_time: true, which predicts "
                      "the val split (python -m videosft.stages.report takes --predict results/predict/summary.json)")


@dataclass
class SourceTime:
    """The predict stage's scores of its merged cut lists in source time, or why there are none."""

    evaluation: dict[str, float | None] | None  # the scores, then the counts behind them
    note: str  # what was scored, or why nothing was

    def rows(self) -> list[tuple[str, float | None]]:
        """(metric, value); None where nothing counts."""
        return list((self.evaluation or {}).items())


def _or_unknown(value, unknown: str = "?"):
    return unknown if value is None else value


def source_time(inputs: Inputs) -> SourceTime:
    if inputs.predict is None:
        return SourceTime(None, NOT_IN_THIS_REPORT)
    summary, reason = optional(lambda: read.predict_summary(inputs))
    if summary is None:
        return SourceTime(None, reason)
    if summary.evaluation is None:
        return SourceTime(None, f"nothing to score: predict cut {_or_unknown(summary.predicted)} of "
                          f"{_or_unknown(summary.videos)} new videos "
                          f"({_or_unknown(summary.source, 'not the val split')}), which have no annotations. "
                          "Predict with predict.videos: val to score cut lists.")
    evaluation = summary.evaluation
    model = f"model {_or_unknown(summary.model)}" + (f" + adapter {summary.adapter}" if summary.adapter else "")
    return SourceTime(evaluation, f"The predict stage's cut lists of the {evaluation.get('videos')} val videos "
                      f"({model}): each window answered, moved to source time and merged across windows "
                      f"(predict.min_agreement {_or_unknown(summary.min_agreement)}), scored against the "
                      f"annotations' {evaluation.get('moments')} ranges to keep in source seconds")


def window_evaluation(inputs: Inputs) -> tuple[WindowEvaluation | None, str | None]:
    """The verify stage's evaluation per window, or None and why there is none."""
    verify, reason = optional(lambda: read.verify_result(inputs))
    if verify is None:
        return None, reason
    if verify.evaluation is None:
        return None, f"{inputs.verify} has no evaluation"
    return verify.evaluation, None


def evaluation_chart(window: WindowEvaluation | None, reason: str | None, source: SourceTime, out_dir: Path,
                     fmt: str) -> str:
    """Base against fine-tuned per window (the strict reading; the tables have the lenient one too)
    and, beside it, the source-time scores."""
    rows = [row for row in window.metrics if not row[0].startswith("lenient_")] if window else []
    scores = [(name, value) for name, value in source.rows() if name in SOURCE_TIME_SCORES]
    if not rows and not scores:
        raise Missing(reason or "the evaluation has no metrics")
    fig = new_figure(max(8.0, 1.1 * len(rows) + 2) + (0.9 * len(scores) + 1 if scores else 0), 5.0)
    axes = fig.subplots(1, 2, width_ratios=[max(len(rows), 3), len(scores)]) if scores else [fig.add_subplot()]
    if rows:
        window_bars(axes[0], rows, window.windows)
    else:
        axis_note(axes[0], f"no window-level evaluation\n{reason}")
        axes[0].set_title("Per window: the val windows, base vs fine-tuned", fontsize=12)
    if scores:
        source_time_bars(axes[1], scores, source.evaluation.get("videos"))
    fig.suptitle("Evaluation", fontsize=13)
    return save(fig, out_dir, "evaluation", fmt)


def window_bars(ax, rows: list[tuple[str, float | None, float | None]], windows: int | None) -> None:
    x = np.arange(len(rows))
    width = 0.4
    for offset, column, label, color in ((-width / 2, 1, "base", "#B0B0B0"), (width / 2, 2, "fine-tuned", "#4C72B0")):
        values = [row[column] if row[column] is not None else math.nan for row in rows]
        label_bars(ax, ax.bar(x + offset, values, width, label=label, color=color), fmt="{:.2f}")
    ax.set_xticks(x, [row[0] + ("\n(lower is better)" if row[0] in LOWER_IS_BETTER else "") for row in rows],
                  rotation=20, ha="right")
    ax.set_ylabel("value (fractions in [0, 1])")
    values = [v for row in rows for v in row[1:] if v is not None]
    if values and 0 <= min(values) and max(values) <= 1:
        ax.set_ylim(0, 1.12)
    ax.set_xlim(-0.8, len(rows) - 0.2)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Per window: {'the' if windows is None else windows} val windows, base vs fine-tuned", fontsize=12)


def source_time_bars(ax, scores: list[tuple[str, float | None]], videos: int | None) -> None:
    values = [math.nan if value is None else value for _, value in scores]
    label_bars(ax, ax.bar(np.arange(len(scores)), values, 0.6, color="#55A868"), fmt="{:.2f}")
    ax.set_xticks(np.arange(len(scores)), [name for name, _ in scores], rotation=20, ha="right")
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("value (fractions in [0, 1])")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"In source time: {videos} val videos' cut lists (predict)", fontsize=12)

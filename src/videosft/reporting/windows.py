"""The windows figure: windows per split, with and without something to keep, beside the samples
the preprocess stage made of them, and the rejects of the window and preprocess stages per reason."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from . import inputs as read
from .drawing import SPLITS, Outcome, axis_note, label_bars, new_figure, save
from .inputs import Inputs, Missing, optional

REJECT_COLORS = {"window": "#C44E52", "preprocess": "#8172B3"}


def windows_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    windows, windows_missing = optional(lambda: read.windows(inputs))
    manifest, _ = optional(lambda: read.manifest(inputs), {})
    rejects: dict[str, list[dict] | None] = {}
    for stage, path in (("window", inputs.window_rejects), ("preprocess", inputs.preprocess_rejects)):
        rejects[stage], reason = optional(lambda path=path, stage=stage: read.rejects(path, stage))
        if reason:
            outcome.notes.append(reason)
    if windows is None and all(items is None for items in rejects.values()):
        raise Missing(windows_missing)

    fig = new_figure(11.0, 4.8)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.3])
    fig.suptitle("Windows per split and rejects per reason", fontsize=13)
    if windows is None:
        axis_note(left, f"no windows\n{windows_missing}")
        outcome.notes.append(windows_missing)
    else:
        window_bars(left, windows, manifest.get("samples"), outcome)
    reject_bars(right, rejects)
    outcome.files.append(save(fig, out_dir, "windows", fmt))
    return outcome


def window_bars(ax, windows: list[dict], samples: dict | None, outcome: Outcome) -> None:
    """Per split, the windows stacked by whether they have something to keep, and beside them the
    samples after preprocess (``samples``: the manifest's count per split)."""
    splits = [s for s in SPLITS if any(w["split"] == s for w in windows)]
    splits += sorted({w["split"] for w in windows} - set(splits))
    keep = np.array([sum(1 for w in windows if w["split"] == s and w["keep_local"]) for s in splits])
    empty = np.array([sum(1 for w in windows if w["split"] == s and not w["keep_local"]) for s in splits])
    x = np.arange(len(splits))
    width = 0.38
    bars_keep = ax.bar(x - width / 2, keep, width, label="window: something to keep", color="#55A868")
    bars_empty = ax.bar(x - width / 2, empty, width, bottom=keep, label="window: nothing to keep",
                        color="#C8C8C8", hatch="//", edgecolor="#888888")
    for bars, values, base in ((bars_keep, keep, 0 * keep), (bars_empty, empty, keep)):
        for bar, value, bottom in zip(bars, values, base):
            if value:
                ax.text(bar.get_x() + bar.get_width() / 2, bottom + value / 2, str(value), ha="center",
                        va="center", fontsize=9)
    if samples:
        counts = np.array([samples.get(s, 0) for s in splits])
        label_bars(ax, ax.bar(x + width / 2, counts, width, label="samples after preprocess", color="#4C72B0"))
    else:
        outcome.notes.append("preprocess manifest not available: no sample counts")
    ax.set_xticks(x, [f"{s}\n({keep[i] + empty[i]} windows)" for i, s in enumerate(splits)])
    ax.set_ylabel("windows / samples")
    ax.set_title(f"{len(windows)} windows")
    ax.legend(fontsize=8, loc="upper right")
    ax.margins(y=0.15)


def reject_bars(ax, rejects: dict[str, list[dict] | None]) -> None:
    """Per stage and reason, how many items it rejected (None: the stage's rejects were not available)."""
    bars = []
    for stage, items in rejects.items():
        if items:
            for reason, count in sorted(Counter(item["reason"] for item in items).items()):
                bars.append((f"{stage}: {reason}", count, REJECT_COLORS[stage]))
    if bars:
        labels, counts, colors = zip(*bars)
        y = np.arange(len(bars))
        label_bars(ax, ax.barh(y, counts, color=colors), horizontal=True)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.set_xlabel("rejected items")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.margins(x=0.15)
    else:
        lines = [f"{stage}: no rejects" if items is not None else f"{stage}: rejects.jsonl not available"
                 for stage, items in rejects.items()]
        axis_note(ax, "\n".join(lines))
    total = sum(len(items or []) for items in rejects.values())
    ax.set_title(f"rejects per reason ({total} in all)")

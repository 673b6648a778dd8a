"""What every figure of the report shares: its :class:`Outcome`, new figures without pyplot, saving,
placeholders that say why a figure has no data, bar labels and histogram bins."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure  # figures without pyplot: no global state, no display

matplotlib.use("Agg")  # files only; never a display

DPI = 110
SPLITS = ("train", "val")
SPLIT_COLORS = {"train": "#4C72B0", "val": "#DD8452"}


@dataclass
class Outcome:
    """What drawing one figure gave: its files, or why it shows no data, and notes on what it lacks."""

    files: list[str] = field(default_factory=list)
    placeholder: str | None = None  # why the figure shows no data
    notes: list[str] = field(default_factory=list)


def new_figure(width: float = 8.0, height: float = 4.8) -> Figure:
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def save(fig: Figure, out_dir: Path, name: str, fmt: str) -> str:
    path = Path(out_dir) / f"{name}.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, small
        fig.savefig(tmp, format=fmt)
    tmp.replace(path)
    return str(path)


def placeholder(out_dir: Path, name: str, title: str, reason: str, fmt: str) -> str:
    """A figure with the title and, where the data would be, why there is none."""
    fig = new_figure(8.0, 3.0)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title, fontsize=13)
    ax.text(0.5, 0.5, f"no data to show\n\n{reason}", ha="center", va="center", fontsize=11, wrap=True,
            color="#444444", transform=ax.transAxes,
            bbox={"boxstyle": "round", "facecolor": "#F3F3F3", "edgecolor": "#BBBBBB"})
    return save(fig, out_dir, name, fmt)


def axis_note(ax, text: str) -> None:
    """A message inside an axis that has nothing to plot."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="#444444", transform=ax.transAxes,
            wrap=True)


def label_bars(ax, bars, fmt: str = "{:g}", horizontal: bool = False) -> None:
    for bar in bars:
        value = bar.get_width() if horizontal else bar.get_height()
        if not math.isfinite(value):  # a value that was not recorded
            where = (0, bar.get_y() + bar.get_height() / 2) if horizontal else (bar.get_x() + bar.get_width() / 2, 0)
            ax.annotate("n/a", where, xytext=(3, 0) if horizontal else (0, 2), textcoords="offset points",
                        ha="left" if horizontal else "center", va="center" if horizontal else "bottom", fontsize=9,
                        color="#C44E52")
            continue
        if horizontal:
            ax.annotate(fmt.format(value), (bar.get_x() + value, bar.get_y() + bar.get_height() / 2),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=9)
        else:
            ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_y() + value),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=9)


def integer_bins(values: np.ndarray, most: int = 30):
    low, high = int(values.min()), int(values.max())
    if high - low < most:
        return np.arange(low - 0.5, high + 1.5)
    return most

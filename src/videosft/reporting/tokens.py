"""The tokens figure: per-sample histograms of frames and of visual, input and supervised tokens per
split, against data.max_length and the frame bounds, with the token budget in force and where it
came from (config or environment)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..data.sample_store import read_metadata, read_samples, sample_files
from . import inputs as read
from .drawing import SPLIT_COLORS, SPLITS, Outcome, integer_bins, new_figure, save
from .inputs import Inputs, Missing

SAMPLE_FACTS = (  # column, axis label
    ("frames", "frames per sample"),
    ("visual_tokens", "visual tokens per sample"),
    ("input_tokens", "input tokens per sample"),
    ("supervised_tokens", "supervised tokens per sample"),
)
COLUMNS = [column for column, _ in SAMPLE_FACTS if column != "frames"] + ["frame_indices", "budget_max_tokens"]


def tokens_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    budget = read.manifest(inputs).get("budget")
    rows = {split: read_samples(inputs.manifest, split, columns=COLUMNS) for split in SPLITS}
    if not any(rows.values()):
        raise Missing(f"no samples in {inputs.manifest}")
    max_length = next(filter(None, (read_metadata(path).get("max_length") for split in SPLITS
                                    for path in sample_files(inputs.manifest, split)[:1])), None)

    fig = new_figure(11.0, 7.6)
    axes = fig.subplots(2, 2).ravel()
    total = sum(len(r) for r in rows.values())
    fig.suptitle(f"Per-sample frames and tokens ({total} samples: "
                 + ", ".join(f"{len(rows[s])} {s}" for s in SPLITS) + ")", fontsize=13)
    for ax, (column, label) in zip(axes, SAMPLE_FACTS):
        per_split = {split: column_values(rows[split], column) for split in SPLITS}
        every = np.concatenate(list(per_split.values()))
        histogram(ax, per_split, every, label)
        if column == "input_tokens" and max_length:
            mark_max_length(ax, every, max_length)
        if column == "frames" and budget:
            mark_frame_bounds(ax, every, budget)
        ax.legend(fontsize=8)
    fig.text(0.01, 0.005, budget_text(budget, rows), fontsize=9, va="bottom", ha="left", family="monospace",
             bbox={"boxstyle": "round", "facecolor": "#F7F7F7", "edgecolor": "#BBBBBB"})
    fig.get_layout_engine().set(rect=(0, 0.11, 1, 0.89))
    return Outcome(files=[save(fig, out_dir, "tokens", fmt)])


def column_values(rows: list[dict], column: str) -> np.ndarray:
    if column == "frames":
        return np.array([len(r["frame_indices"]) for r in rows], dtype=float)
    return np.array([r[column] for r in rows], dtype=float)


def histogram(ax, per_split: dict[str, np.ndarray], every: np.ndarray, label: str) -> None:
    """The splits stacked, with the least, mean and most in the title."""
    present = [s for s in SPLITS if len(per_split[s])]
    ax.hist([per_split[s] for s in present], bins=integer_bins(every), stacked=True,
            color=[SPLIT_COLORS[s] for s in present], label=present, edgecolor="white")
    ax.set_xlabel(label)
    ax.set_ylabel("samples")
    ax.set_title(f"{label}: min {every.min():g}, mean {every.mean():.1f}, max {every.max():g}", fontsize=10)
    if every.min() == every.max():  # one value: a bar of sensible width, not one filling the axis
        ax.set_xlim(every.min() - max(2.0, 0.1 * abs(every.min())), every.max() + max(2.0, 0.1 * abs(every.max())))


def mark_max_length(ax, every: np.ndarray, max_length: int) -> None:
    if max_length <= 1.5 * every.max():
        ax.axvline(max_length, color="#C44E52", linestyle="--", label=f"data.max_length = {max_length}")
        ax.set_xlim(right=max(max_length * 1.05, every.max() + 1))
    else:  # far to the right: a line there would squeeze the histogram into one pixel
        ax.set_title(ax.get_title() + f"\n(data.max_length = {max_length}, "
                     f"{every.max() / max_length:.0%} used at most)", fontsize=10)


def mark_frame_bounds(ax, every: np.ndarray, budget: dict) -> None:
    bounds = []
    for key, style in (("min_frames", ":"), ("max_frames", "--")):
        if isinstance(budget.get(key), (int, float)):
            bounds.append(budget[key])
            ax.axvline(budget[key], color="#777777", linestyle=style, label=f"video.{key} = {budget[key]}")
    if bounds:
        ax.set_xlim(min(bounds + [every.min()]) - 1, max(bounds + [every.max()]) + 1)


def budget_text(budget: dict | None, rows: dict[str, list[dict]]) -> str:
    """The token budget in force, where its bounds came from, and how many samples were fitted below it."""
    if not budget:
        return "token budget: not recorded in the preprocess manifest"
    lines = [
        f"token budget in force: {budget.get('min_tokens')}-{budget.get('max_tokens')} merged visual tokens per frame "
        f"pair (min from {budget.get('min_tokens_from', '?')}; max from {budget.get('max_tokens_from', '?')})",
        f"sampling: {budget.get('fps')} fps, {budget.get('min_frames')}-{budget.get('max_frames')} frames per window",
    ]
    overrides = environment_overrides(budget)
    if overrides:
        lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())))
    if budget.get("max_tokens") is not None:
        samples = [r for split in SPLITS for r in rows[split]]
        fitted = sum(1 for r in samples
                     if r.get("budget_max_tokens") is not None and r["budget_max_tokens"] < budget["max_tokens"])
        lines.append(f"{fitted} of {len(samples)} samples fitted to a smaller per-frame budget to stay under "
                     "data.max_length")
    return "\n".join(lines)


def environment_overrides(budget: dict) -> dict[str, object]:
    """The budget's bounds taken from environment variables, by variable: the budget records where
    each came from (:func:`videosft.media.budget.resolve_budget`), so the preprocess stage's
    environment need not be read from its run record."""
    overrides = {}
    for key in ("min_tokens", "max_tokens"):
        source = str(budget.get(f"{key}_from", ""))
        if source.startswith("environment "):
            overrides[source.removeprefix("environment ")] = budget.get(key)
    return overrides

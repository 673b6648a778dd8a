"""Stage 6, report: figures of what the other stages did, for ``snakemake --report report.html``.

Reads the outputs of window, preprocess, probe, train and verify (and, if given, predict) and
draws one figure each (PNG by default) into ``--out``:

``windows``     windows per split, with and without something to keep, and samples after preprocess;
                rejects per reason of the window and preprocess stages
``tokens``      per-sample histograms of frames and visual / input / supervised tokens, with the token
                budget in force and where it came from (config or environment)
``loss``        training loss per rank over the steps
``memory``      peak memory per rank over the steps against the planner's prediction
``load``        checkpoint load and load-verification times of train and verify
``evaluation``  base vs fine-tuned for every metric of the verify stage's evaluation per window, and
                beside it the predict stage's scores of its merged cut lists in source time (``--predict``,
                when it predicted the val split; a folder of new videos has nothing to score, and the
                report says so); also written as ``evaluation.html`` (both tables, every metric
                defined beside its value, and the answers), ``evaluation.csv`` and
                ``evaluation_source_time.csv``

Every input is optional: a missing or empty one gives a figure that says so instead of a failure,
and the run record lists which figures are placeholders and why.

    python -m videosft.stages.report --config config.yaml --results results --out results/report
"""

from __future__ import annotations

import csv
import html
import json
import math
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import matplotlib
import numpy as np
import pyarrow.parquet as pq
from matplotlib.figure import Figure  # figures without pyplot: no global state, no display

from .. import config as config_lib
from ..evaluation.answers import COUNTS, definition
from ..evaluation.metrics import SOURCE_TIME_DEFINITIONS, WINDOW_R1_THRESHOLDS
from ..provenance import exit_after, run_record, stage_parser
from ..data.sample_store import read_metadata, read_samples, sample_files

matplotlib.use("Agg")  # files only; never a display

FIGURES = ("windows", "tokens", "loss", "memory", "load", "evaluation")
TABLES = ("evaluation.html", "evaluation.csv", "evaluation_source_time.csv")
SPLITS = ("train", "val")
SAMPLE_FACTS = (  # column, axis label
    ("frames", "frames per sample"),
    ("visual_tokens", "visual tokens per sample"),
    ("input_tokens", "input tokens per sample"),
    ("supervised_tokens", "supervised tokens per sample"),
)
SPLIT_COLORS = {"train": "#4C72B0", "val": "#DD8452"}
DPI = 110


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
    train: Path | None = None  # the train stage's run_record.json; steps.rank*.jsonl lie beside it
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
            verify=results / "verify" / "verify.json",
            predict=results / "predict" / "summary.json",
        )

    def described(self) -> dict[str, dict[str, Any]]:
        return {name: {"path": None if path is None else str(path), "exists": path is not None and Path(path).exists()}
                for name, path in vars(self).items()}


@dataclass
class Outcome:
    files: list[str] = field(default_factory=list)
    placeholder: str | None = None  # why the figure shows no data
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# reading


def _need(path: Path | None, what: str) -> Path:
    if path is None:
        raise Missing(f"{what}: not given")
    path = Path(path)
    if not path.exists():
        raise Missing(f"{what}: {path} not found")
    return path


def read_json(path: Path | None, what: str) -> dict:
    path = _need(path, what)
    text = path.read_text()
    if not text.strip():
        raise Missing(f"{what}: {path} is empty")
    return json.loads(text)


def read_jsonl(path: Path | None, what: str) -> list[dict]:
    path = _need(path, what)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def optional(read: Callable[[], Any], default: Any = None) -> tuple[Any, str | None]:
    """Call ``read``; a Missing input gives ``default`` and the reason."""
    try:
        return read(), None
    except Missing as missing:
        return default, str(missing)


def dig(mapping: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return default
        mapping = mapping[key]
    return mapping


def train_results(inputs: Inputs) -> dict:
    record = read_json(inputs.train, "train run record")
    return record.get("results") or {}


def step_logs(inputs: Inputs) -> dict[int, list[dict]]:
    """Rank -> its step entries, from the ``steps.rank*.jsonl`` beside the train run record."""
    directory = _need(inputs.train, "train run record").parent
    logs = {}
    for path in sorted(directory.glob("steps.rank*.jsonl")):
        suffix = path.name[len("steps.rank"):-len(".jsonl")]
        if suffix.isdigit():
            logs[int(suffix)] = [entry for entry in read_jsonl(path, path.name) if "step" in entry]
    if not any(logs.values()):
        raise Missing(f"train step logs: no steps.rank*.jsonl with entries in {directory}")
    return dict(sorted(logs.items()))


# ----------------------------------------------------------------------------------------------
# drawing helpers


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


# ----------------------------------------------------------------------------------------------
# 1. windows and rejects


def windows_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    windows, windows_missing = optional(
        lambda: pq.read_table(_need(inputs.windows, "windows"), columns=["split", "keep_local"]).to_pylist())
    manifest, _ = optional(lambda: read_json(inputs.manifest, "preprocess manifest"), {})
    rejects: dict[str, list[dict] | None] = {}
    for stage, path in (("window", inputs.window_rejects), ("preprocess", inputs.preprocess_rejects)):
        rejects[stage], reason = optional(lambda path=path, stage=stage: read_jsonl(path, f"{stage} rejects"))
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
        splits = [s for s in SPLITS if any(w["split"] == s for w in windows)]
        splits += sorted({w["split"] for w in windows} - set(splits))
        keep = np.array([sum(1 for w in windows if w["split"] == s and w["keep_local"]) for s in splits])
        empty = np.array([sum(1 for w in windows if w["split"] == s and not w["keep_local"]) for s in splits])
        x = np.arange(len(splits))
        width = 0.38
        bars_keep = left.bar(x - width / 2, keep, width, label="window: something to keep", color="#55A868")
        bars_empty = left.bar(x - width / 2, empty, width, bottom=keep, label="window: nothing to keep",
                              color="#C8C8C8", hatch="//", edgecolor="#888888")
        for bars, values, base in ((bars_keep, keep, 0 * keep), (bars_empty, empty, keep)):
            for bar, value, bottom in zip(bars, values, base):
                if value:
                    left.text(bar.get_x() + bar.get_width() / 2, bottom + value / 2, str(value), ha="center",
                              va="center", fontsize=9)
        samples = manifest.get("samples") if isinstance(manifest, dict) else None
        if samples:
            counts = np.array([samples.get(s, 0) for s in splits])
            label_bars(left, left.bar(x + width / 2, counts, width, label="samples after preprocess",
                                      color="#4C72B0"))
        else:
            outcome.notes.append("preprocess manifest not available: no sample counts")
        left.set_xticks(x, [f"{s}\n({keep[i] + empty[i]} windows)" for i, s in enumerate(splits)])
        left.set_ylabel("windows / samples")
        left.set_title(f"{len(windows)} windows")
        left.legend(fontsize=8, loc="upper right")
        left.margins(y=0.15)

    bars = []
    for stage, items in rejects.items():
        if items:
            for reason, count in sorted(Counter(item.get("reason", "?") for item in items).items()):
                bars.append((f"{stage}: {reason}", count, "#C44E52" if stage == "window" else "#8172B3"))
    if bars:
        labels, counts, colors = zip(*bars)
        y = np.arange(len(bars))
        label_bars(right, right.barh(y, counts, color=colors), horizontal=True)
        right.set_yticks(y, labels)
        right.invert_yaxis()
        right.set_xlabel("rejected items")
        right.xaxis.get_major_locator().set_params(integer=True)
        right.margins(x=0.15)
    else:
        lines = [f"{stage}: no rejects" if items is not None else f"{stage}: rejects.jsonl not available"
                 for stage, items in rejects.items()]
        axis_note(right, "\n".join(lines))
    total = sum(len(items or []) for items in rejects.values())
    right.set_title(f"rejects per reason ({total} in all)")
    outcome.files.append(save(fig, out_dir, "windows", fmt))
    return outcome


# ----------------------------------------------------------------------------------------------
# 2. tokens per sample


def budget_text(budget: dict | None, env: dict | None) -> str:
    if not budget:
        return "token budget: not recorded in the preprocess manifest"
    lines = [
        f"token budget in force: {budget.get('min_tokens')}-{budget.get('max_tokens')} merged visual tokens per frame "
        f"pair (min from {budget.get('min_tokens_from', '?')}; max from {budget.get('max_tokens_from', '?')})",
        f"sampling: {budget.get('fps')} fps, {budget.get('min_frames')}-{budget.get('max_frames')} frames per window",
    ]
    overrides = {k: v for k, v in (env or {}).items() if k.startswith("VIDEO_")}
    if overrides:
        lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())))
    return "\n".join(lines)


def tokens_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    manifest = read_json(inputs.manifest, "preprocess manifest")
    columns = [column for column, _ in SAMPLE_FACTS if column != "frames"] + ["frame_indices", "budget_max_tokens"]
    rows: dict[str, list[dict]] = {}
    max_length = None
    for split in SPLITS:
        rows[split] = read_samples(inputs.manifest, split, columns=columns) if manifest.get("files", {}).get(split) \
            else []
        for path in sample_files(inputs.manifest, split)[:1]:
            max_length = max_length or read_metadata(path).get("max_length")
    if not any(rows.values()):
        raise Missing(f"no samples in {inputs.manifest}")
    record, _ = optional(lambda: read_json(Path(inputs.manifest).parent / "run_record.json", "preprocess record"))
    budget = manifest.get("budget")

    fig = new_figure(11.0, 7.6)
    axes = fig.subplots(2, 2).ravel()
    total = sum(len(r) for r in rows.values())
    fig.suptitle(f"Per-sample frames and tokens ({total} samples: "
                 + ", ".join(f"{len(rows[s])} {s}" for s in SPLITS) + ")", fontsize=13)
    for ax, (column, label) in zip(axes, SAMPLE_FACTS):
        per_split = {}
        for split in SPLITS:
            if column == "frames":
                per_split[split] = np.array([len(r["frame_indices"]) for r in rows[split]], dtype=float)
            else:
                per_split[split] = np.array([r[column] for r in rows[split]], dtype=float)
        every = np.concatenate(list(per_split.values()))
        present = [s for s in SPLITS if len(per_split[s])]
        ax.hist([per_split[s] for s in present], bins=integer_bins(every), stacked=True,
                color=[SPLIT_COLORS[s] for s in present], label=present, edgecolor="white")
        ax.set_xlabel(label)
        ax.set_ylabel("samples")
        ax.set_title(f"{label}: min {every.min():g}, mean {every.mean():.1f}, max {every.max():g}", fontsize=10)
        if every.min() == every.max():  # one value: a bar of sensible width, not one filling the axis
            ax.set_xlim(every.min() - max(2.0, 0.1 * abs(every.min())), every.max() + max(2.0, 0.1 * abs(every.max())))
        if column == "input_tokens" and max_length:
            if max_length <= 1.5 * every.max():
                ax.axvline(max_length, color="#C44E52", linestyle="--", label=f"data.max_length = {max_length}")
                ax.set_xlim(right=max(max_length * 1.05, every.max() + 1))
            else:  # far to the right: a line there would squeeze the histogram into one pixel
                ax.set_title(ax.get_title() + f"\n(data.max_length = {max_length}, "
                             f"{every.max() / max_length:.0%} used at most)", fontsize=10)
        if column == "frames" and budget:
            bounds = []
            for key, style in (("min_frames", ":"), ("max_frames", "--")):
                if isinstance(budget.get(key), (int, float)):
                    bounds.append(budget[key])
                    ax.axvline(budget[key], color="#777777", linestyle=style, label=f"video.{key} = {budget[key]}")
            if bounds:
                ax.set_xlim(min(bounds + [every.min()]) - 1, max(bounds + [every.max()]) + 1)
        ax.legend(fontsize=8)
    text = budget_text(budget, (record or {}).get("env"))
    if budget and budget.get("max_tokens") is not None:
        fitted = sum(1 for split in SPLITS for r in rows[split]
                     if r.get("budget_max_tokens") is not None and r["budget_max_tokens"] < budget["max_tokens"])
        text += f"\n{fitted} of {total} samples fitted to a smaller per-frame budget to stay under data.max_length"
    fig.text(0.01, 0.005, text, fontsize=9, va="bottom", ha="left", family="monospace",
             bbox={"boxstyle": "round", "facecolor": "#F7F7F7", "edgecolor": "#BBBBBB"})
    fig.get_layout_engine().set(rect=(0, 0.11, 1, 0.89))
    outcome.files.append(save(fig, out_dir, "tokens", fmt))
    return outcome


# ----------------------------------------------------------------------------------------------
# 3. loss and 4. memory over steps


def loss_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    logs = step_logs(inputs)
    fig = new_figure()
    ax = fig.add_subplot()
    for rank, entries in logs.items():
        points = [(e["step"], e["loss"]) for e in entries if isinstance(e.get("loss"), (int, float))]
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, marker="o", label=f"rank {rank}")
    if not ax.lines:
        raise Missing("train step logs have no loss values")
    results, _ = optional(lambda: train_results(inputs), {})
    world = results.get("world_size", len(logs))
    ax.set_title(f"Training loss per rank ({world} rank{'s' if world != 1 else ''}, "
                 f"{results.get('device', '?')}, {results.get('precision', '?')})", fontsize=13)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over supervised tokens)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    return Outcome(files=[save(fig, out_dir, "loss", fmt)])


MEMORY_KEYS = (  # step log key, legend, line style
    ("peak_allocated_gib", "allocated", "-"),
    ("peak_reserved_gib", "reserved", "--"),
    ("peak_rss_gib", "RSS (CPU)", "-"),
)


def memory_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    results, results_missing = optional(lambda: train_results(inputs), {})
    logs, logs_missing = optional(lambda: step_logs(inputs), {})
    measured = dig(results, "memory", "measured", default={}) or {}
    if not logs and not measured:
        raise Missing(logs_missing or results_missing or "no memory measurements")
    fig = new_figure(9.0, 5.2)
    ax = fig.add_subplot()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    cpu = False
    for index, rank in enumerate(sorted(set(logs) | {int(r) for r in measured})):
        color = colors[index % len(colors)]
        for key, legend, style in MEMORY_KEYS:
            points = [(e["step"], e[key]) for e in logs.get(rank, []) if isinstance(e.get(key), (int, float))]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, style, marker="o", color=color, label=f"rank {rank} peak {legend}")
            elif not logs.get(rank) and isinstance(dig(measured, str(rank), key), (int, float)):
                ax.plot([0], [measured[str(rank)][key]], marker="s", linestyle="none", color=color,
                        label=f"rank {rank} peak {legend} (run record)")
            else:
                continue
            cpu = cpu or key == "peak_rss_gib"
    predicted = dig(results, "memory", "predicted")
    if predicted:
        for key, legend, style in (("allocated_gib", "allocated", "-"), ("reserved_gib", "reserved", "--")):
            if isinstance(predicted.get(key), (int, float)):
                ax.axhline(predicted[key], color="black", linestyle=style, linewidth=1.2,
                           label=f"predicted {legend} ({predicted[key]:.3g} GiB)")
    else:
        outcome.notes.append("no prediction in the train run record (probe had no memory plan)")
    probe, _ = optional(lambda: read_json(inputs.probe, "probe"), {})
    limit = dig(probe, "memory", "gpu_memory_gib")
    if limit and not cpu and str(results.get("device", "")).startswith("cuda"):
        ax.axhline(limit, color="#C44E52", linestyle="-.", label=f"GPU memory limit ({limit:g} GiB)")
    ax.set_title(f"Peak memory per rank over steps vs the planner's prediction ({results.get('device', '?')})",
                 fontsize=12)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if cpu:
        ax.text(1.02, 0.0, "CPU run: RSS is the whole\nprocess (interpreter, libraries,\ntensors); the prediction is\n"
                "accelerator memory, so the two\nare not expected to agree.",
                fontsize=8, transform=ax.transAxes, va="bottom", ha="left", color="#444444")
    if not predicted:
        ax.text(0.99, 0.98, "no prediction recorded", fontsize=9, transform=ax.transAxes, ha="right", va="top")
    outcome.files.append(save(fig, out_dir, "memory", fmt))
    return outcome


# ----------------------------------------------------------------------------------------------
# 5. load times


def load_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    results, train_missing = optional(lambda: train_results(inputs), {})
    verify, verify_missing = optional(lambda: read_json(inputs.verify, "verify"), {})
    load = results.get("load") or {}
    bars = []
    for key, label in (("build_and_load_seconds", "train: build model + load checkpoint"),
                       ("load_seconds", "train: load checkpoint into ZeRO-3 partitions"),
                       ("verify_seconds", "train: compare loaded entries with the file")):
        if isinstance(load.get(key), (int, float)):
            bars.append((label, load[key], "#4C72B0"))
    if isinstance(verify.get("load_seconds"), (int, float)):
        bars.append(("verify: load base + adapter (no DeepSpeed)", verify["load_seconds"], "#55A868"))
    for reason in (train_missing, verify_missing):
        if reason:
            outcome.notes.append(reason)
    if not bars:
        raise Missing("; ".join(filter(None, [train_missing, verify_missing])) or "no load times recorded")
    fig = new_figure(9.0, 1.6 + 0.6 * len(bars))
    ax = fig.add_subplot()
    labels, seconds, colors = zip(*bars)
    y = np.arange(len(bars))
    label_bars(ax, ax.barh(y, seconds, color=colors), fmt="{:.3g} s", horizontal=True)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.margins(x=0.2)
    summary = load.get("summary")
    ax.set_title("Model load and load-verification times" + (f" ({summary})" if summary else ""), fontsize=12)
    outcome.files.append(save(fig, out_dir, "load", fmt))
    return outcome


# ----------------------------------------------------------------------------------------------
# 6. evaluation: per window (verify) and, where predict scored its cut lists, in source time


LOWER_IS_BETTER = {"unparseable_rate", "degenerate_rate", "false_keep_rate", "lenient_false_keep_rate"}
SOURCE_TIME_SCORES = [f"R1@{t}" for t in WINDOW_R1_THRESHOLDS] + ["mIoU", "keep_precision", "keep_recall"]
SOURCE_TIME_COUNTS = ["videos", "moments", "kept_seconds", "target_seconds"]


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def evaluation_rows(evaluation: dict) -> list[tuple[str, float | None, float | None]]:
    """(metric, base, fine-tuned) for every numeric metric; the sample count is left out."""
    base, tuned = evaluation.get("base") or {}, evaluation.get("fine_tuned") or {}
    names = [k for k in base if k not in COUNTS] + [k for k in tuned if k not in base and k not in COUNTS]
    rows = [(name, number(base.get(name)), number(tuned.get(name))) for name in names]
    return [row for row in rows if row[1] is not None or row[2] is not None]


@dataclass
class SourceTime:
    """The predict stage's scores of its merged cut lists in source time, or why there are none."""

    evaluation: dict | None
    note: str  # what was scored, or why nothing was

    def rows(self) -> list[tuple[str, float | None]]:
        """(metric, value) for the scores, then the counts behind them; None where nothing counts."""
        evaluation = self.evaluation or {}
        return [(name, number(evaluation.get(name))) for name in SOURCE_TIME_SCORES + SOURCE_TIME_COUNTS
                if name in evaluation]


def source_time(inputs: Inputs) -> SourceTime:
    if inputs.predict is None:
        return SourceTime(None, "not part of this report: the workflow adds it with report.source_time: true, "
                          "which predicts the val split (python -m videosft.stages.report takes --predict "
                          "results/predict/summary.json)")
    summary, reason = optional(lambda: read_json(inputs.predict, "predict summary"))
    if summary is None:
        return SourceTime(None, reason)
    evaluation = summary.get("evaluation")
    if not evaluation:
        return SourceTime(None, f"nothing to score: predict cut {summary.get('predicted', '?')} of "
                          f"{summary.get('videos', '?')} new videos ({summary.get('source', 'not the val split')}), "
                          "which have no annotations. Predict with predict.videos: val to score cut lists.")
    model = f"model {summary.get('model', '?')}" + (f" + adapter {summary['adapter']}" if summary.get("adapter")
                                                      else "")
    return SourceTime(evaluation, f"The predict stage's cut lists of the {evaluation.get('videos')} val videos "
                      f"({model}): each window answered, moved to source time and merged across windows "
                      f"(predict.min_agreement {summary.get('min_agreement', '?')}), scored against the "
                      f"annotations' {evaluation.get('moments')} ranges to keep in source seconds")


def evaluation_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    verify, reason = optional(lambda: read_json(inputs.verify, "verify"))
    evaluation = (verify or {}).get("evaluation")
    if verify is not None and not evaluation:
        reason = f"{inputs.verify} has no evaluation"
    source = source_time(inputs)
    tables = write_tables(evaluation, reason, source, out_dir)
    # the chart shows the strict reading; the tables have the lenient one too
    rows = [row for row in evaluation_rows(evaluation) if not row[0].startswith("lenient_")] if evaluation else []
    scores = [(name, value) for name, value in source.rows() if name in SOURCE_TIME_SCORES]
    if not rows and not scores:
        raise Missing(reason or "the evaluation has no metrics")
    fig = new_figure(max(8.0, 1.1 * len(rows) + 2) + (0.9 * len(scores) + 1 if scores else 0), 5.0)
    axes = fig.subplots(1, 2, width_ratios=[max(len(rows), 3), len(scores)]) if scores else [fig.add_subplot()]
    ax = axes[0]
    if rows:
        x = np.arange(len(rows))
        width = 0.4
        for offset, column, label, color in ((-width / 2, 1, "base", "#B0B0B0"),
                                             (width / 2, 2, "fine-tuned", "#4C72B0")):
            values = [row[column] if row[column] is not None else math.nan for row in rows]
            label_bars(ax, ax.bar(x + offset, values, width, label=label, color=color), fmt="{:.2f}")
        ax.set_xticks(x, [row[0] + ("\n(lower is better)" if row[0] in LOWER_IS_BETTER else "") for row in rows],
                      rotation=20, ha="right")
        ax.set_ylabel("value (fractions in [0, 1])")
        values = [v for row in rows for v in row[1:] if v is not None]
        if values and 0 <= min(values) and max(values) <= 1:
            ax.set_ylim(0, 1.12)
        windows = evaluation.get("windows", dig(evaluation, "base", "num_samples"))
        ax.set_xlim(-0.8, len(rows) - 0.2)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    else:
        axis_note(ax, f"no window-level evaluation\n{reason}")
        windows = None
    ax.set_title(f"Per window: {'the' if windows is None else windows} val windows, base vs fine-tuned",
                 fontsize=12)
    if scores:
        right = axes[1]
        values = [math.nan if value is None else value for _, value in scores]
        label_bars(right, right.bar(np.arange(len(scores)), values, 0.6, color="#55A868"), fmt="{:.2f}")
        right.set_xticks(np.arange(len(scores)), [name for name, _ in scores], rotation=20, ha="right")
        right.set_ylim(0, 1.12)
        right.set_ylabel("value (fractions in [0, 1])")
        right.grid(axis="y", alpha=0.3)
        right.set_title(f"In source time: {source.evaluation.get('videos')} val videos' cut lists (predict)",
                        fontsize=12)
    fig.suptitle("Evaluation", fontsize=13)
    return Outcome(files=[save(fig, out_dir, "evaluation", fmt), *tables])


def write_tables(evaluation: dict | None, reason: str | None, source: SourceTime, out_dir: Path) -> list[str]:
    """evaluation.csv (per window), evaluation_source_time.csv and evaluation.html with both, every
    metric with its definition."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = evaluation_rows(evaluation) if evaluation else []

    def cell(value):
        return "" if value is None else f"{value:.4f}"

    with open(out_dir / "evaluation.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["metric", "base", "fine_tuned", "difference", "definition"])
        for name, base, tuned in rows:
            writer.writerow([name, cell(base), cell(tuned),
                             cell(tuned - base) if base is not None and tuned is not None else "", definition(name)])
    with open(out_dir / "evaluation_source_time.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["metric", "value", "definition"])
        for name, value in source.rows():
            writer.writerow([name, cell(value), SOURCE_TIME_DEFINITIONS.get(name, "")])
    parts = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'><title>Evaluation</title>",
             "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}"
             "td,th{border:1px solid #bbb;padding:4px 10px}td.n{text-align:right;font-family:monospace}"
             "th{background:#eee}td.t{font-family:monospace;white-space:pre-wrap;max-width:40em}"
             "td.d{color:#444;max-width:40em}.better{color:#1a7f37}.worse{color:#c0392b}</style></head><body>"]
    parts.append("<h2>Evaluation per window: base vs fine-tuned</h2>")
    if not rows:
        parts.append(f"<p>No evaluation to show: {html.escape(reason or 'the verify stage recorded no metrics')}</p>")
    else:
        windows = evaluation.get("windows", dig(evaluation, "base", "num_samples"))
        parts.append(f"<p>{html.escape(str(windows))} validation windows, greedy decoding, window-local time "
                     "(from the verify stage).</p>")
        parts.append("<table><tr><th>metric</th><th>base</th><th>fine-tuned</th><th>difference</th>"
                     "<th>definition</th></tr>")
        for name, base, tuned in rows:
            difference = tuned - base if base is not None and tuned is not None else None
            css = "" if not difference else \
                " better" if (difference < 0 if name in LOWER_IS_BETTER else difference > 0) else " worse"
            parts.append(f"<tr><td>{html.escape(name)}</td><td class='n'>{cell(base)}</td><td class='n'>{cell(tuned)}"
                         f"</td><td class='n{css}'>{'' if difference is None else f'{difference:+.4f}'}</td>"
                         f"<td class='d'>{html.escape(definition(name))}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Evaluation in source time: the cut lists</h2>")
    parts.append(f"<p>{html.escape(source.note)}.</p>" if source.evaluation is not None else
                 f"<p>No source-time evaluation to show: {html.escape(source.note)}</p>")
    if source.evaluation is not None:
        parts.append("<table><tr><th>metric</th><th>value</th><th>definition</th></tr>")
        for name, value in source.rows():
            shown = "-" if value is None else (f"{value:.1f}" if name.endswith("_seconds") else
                                               f"{value:g}" if name in SOURCE_TIME_COUNTS else f"{value:.4f}")
            parts.append(f"<tr><td>{html.escape(name)}</td><td class='n'>{shown}</td>"
                         f"<td class='d'>{html.escape(SOURCE_TIME_DEFINITIONS.get(name, ''))}</td></tr>")
        parts.append("</table>")
    answers = (evaluation or {}).get("answers") or []
    if rows and answers:
        parts.append("<h3>Answers per window</h3><table><tr><th>window</th><th>target</th><th>base</th>"
                     "<th>fine-tuned</th></tr>")
        for answer in answers:
            target = ", ".join(f"{s:.1f}-{e:.1f}" for s, e in answer.get("target") or []) or "none"
            texts = [html.escape(_shown(answer.get(key))) for key in ("base", "fine_tuned")]
            parts.append(f"<tr><td>{html.escape(str(answer.get('window_id')))}</td><td class='t'>{target}</td>"
                         f"<td class='t'>{texts[0]}</td><td class='t'>{texts[1]}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    (out_dir / "evaluation.html").write_text("\n".join(parts) + "\n")
    return [str(out_dir / name) for name in TABLES]


def _shown(text: Any, limit: int = 200) -> str:
    """A model answer as a reader can see it: control characters spelled out, long ones cut."""
    if text is None:
        return ""
    text = repr(str(text))[1:-1]
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# ----------------------------------------------------------------------------------------------

BUILDERS: dict[str, tuple[str, Callable[[Inputs, Path, str], Outcome]]] = {
    "windows": ("Windows per split and rejects per reason", windows_figure),
    "tokens": ("Per-sample frames and tokens", tokens_figure),
    "loss": ("Training loss per rank", loss_figure),
    "memory": ("Peak memory per rank vs the planner's prediction", memory_figure),
    "load": ("Model load and load-verification times", load_figure),
    "evaluation": ("Evaluation: base vs fine-tuned", evaluation_figure),
}


def make_report(inputs: Inputs, out_dir: Path, fmt: str = "png") -> dict:
    """Draw every figure; an absent input or a figure that fails gives a placeholder, never a crash."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, dict] = {}
    problems = []
    for name, (title, build) in BUILDERS.items():
        try:
            outcome = build(inputs, out_dir, fmt)
        except Missing as missing:
            outcome = Outcome(placeholder=str(missing))
        except Exception as error:  # a figure that cannot be drawn must not hide the others
            traceback.print_exc()
            outcome = Outcome(placeholder=f"could not draw: {type(error).__name__}: {error}")
            problems.append(f"{name}: {type(error).__name__}: {error}")
        if outcome.placeholder is not None:
            outcome.files = [placeholder(out_dir, name, title, outcome.placeholder, fmt)] + \
                [f for f in outcome.files if not f.endswith(f"{name}.{fmt}")]
        if name == "evaluation" and not all((out_dir / table).exists() for table in TABLES):
            outcome.files += write_tables(None, outcome.placeholder, source_time(inputs), out_dir)
        figures[name] = {"files": outcome.files, "placeholder": outcome.placeholder, "notes": outcome.notes}
        state = f"placeholder ({outcome.placeholder})" if outcome.placeholder else "ok"
        print(f"report: {name}: {state}; " + ", ".join(Path(f).name for f in outcome.files), flush=True)
    source = source_time(inputs)
    print(f"report: source-time evaluation: {'shown' if source.evaluation else 'none'} ({source.note})", flush=True)
    return {"figures": figures, "inputs": inputs.described(), "format": fmt,
            "source_time": {"shown": source.evaluation is not None, "note": source.note},
            "placeholders": sorted(n for n, f in figures.items() if f["placeholder"]), "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--results", type=Path, help="the workflow's results directory: every input below at its "
                        "usual place (the options below override single inputs)")
    for name, help_text in (("windows", "windows.parquet of the window stage"),
                            ("window-rejects", "rejects.jsonl of the window stage"),
                            ("manifest", "manifest.json of the preprocess stage"),
                            ("preprocess-rejects", "rejects.jsonl of the preprocess stage"),
                            ("probe", "probe.json of the probe stage"),
                            ("train", "run_record.json of the train stage (steps.rank*.jsonl are read beside it)"),
                            ("verify", "verify.json of the verify stage"),
                            ("predict", "summary.json of the predict stage (scored in source time when it "
                             "predicted the val split)")):
        parser.add_argument(f"--{name}", type=Path, help=help_text)
    parser.add_argument("--format", choices=("png", "svg"), default="png", help="figure file format (default png)")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "report")
    inputs = Inputs.under(args.results) if args.results else Inputs()
    for name in vars(inputs):
        if getattr(args, name) is not None:
            setattr(inputs, name, getattr(args, name))
    with run_record("report", args.out, cfg, args) as record:
        record["results"] = make_report(inputs, args.out, args.format)
        placeholders = record["results"]["placeholders"]
        print(f"report: {len(FIGURES)} figures in {args.out}"
              + (f", {len(placeholders)} without data: {', '.join(placeholders)}" if placeholders else ""))
    return 0


if __name__ == "__main__":
    exit_after(main)

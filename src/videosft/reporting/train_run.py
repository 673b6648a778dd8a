"""The figures of the training run: loss per rank over the steps, peak memory per rank against the
planner's prediction, and the model load and load-verification times of train and verify."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

from ..data.records import number
from ..data.train_results import TrainResults
from . import inputs as read
from .drawing import Outcome, label_bars, new_figure, save
from .inputs import Inputs, Missing, optional

MEMORY_KEYS = (  # step log key, legend, line style
    ("peak_allocated_gib", "allocated", "-"),
    ("peak_reserved_gib", "reserved", "--"),
    ("peak_rss_gib", "RSS (CPU)", "-"),
)
PREDICTED_KEYS = (("allocated_gib", "allocated", "-"), ("reserved_gib", "reserved", "--"))
LOAD_LABELS = {
    "build_and_load_seconds": "train: build model + load checkpoint",
    "load_seconds": "train: load checkpoint (into ZeRO-3 partitions on several ranks)",
    "verify_seconds": "train: compare loaded entries with the file",
}
CPU_NOTE = ("CPU run: RSS is the whole\nprocess (interpreter, libraries,\ntensors); the prediction is\n"
            "accelerator memory, so the two\nare not expected to agree.")


def series(entries: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the step entries that recorded a number under ``key``."""
    return [(entry["step"], entry[key]) for entry in entries if number(entry.get(key)) is not None]


def loss_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    logs = read.step_logs(inputs)
    fig = new_figure()
    ax = fig.add_subplot()
    for rank, entries in logs.items():
        points = series(entries, "loss")
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, marker="o", label=f"rank {rank}")
    if not ax.lines:
        raise Missing("train step logs have no loss values")
    results, _ = optional(lambda: read.train_results(inputs), TrainResults())
    world = len(logs) if results.world_size is None else results.world_size
    ax.set_title(f"Training loss per rank ({world} rank{'s' if world != 1 else ''}, "
                 f"{results.device or '?'}, {results.precision or '?'})", fontsize=13)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over supervised tokens)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    return Outcome(files=[save(fig, out_dir, "loss", fmt)])


def memory_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    results, results_missing = optional(lambda: read.train_results(inputs), TrainResults())
    logs, logs_missing = optional(lambda: read.step_logs(inputs), {})
    if not logs and not results.measured_gib:
        raise Missing(logs_missing or results_missing or "no memory measurements")
    fig = new_figure(9.0, 5.2)
    ax = fig.add_subplot()
    cpu = plot_peaks(ax, logs, results.measured_gib)
    for key, legend, style in PREDICTED_KEYS:
        if key in results.predicted_gib:
            value = results.predicted_gib[key]
            ax.axhline(value, color="black", linestyle=style, linewidth=1.2,
                       label=f"predicted {legend} ({value:.3g} GiB)")
    if not results.predicted_gib:
        outcome.notes.append("no prediction in the train run record (probe had no memory plan)")
    limit, _ = optional(lambda: read.planned_gpu_memory(inputs))
    shared, _ = optional(lambda: read.sequence_plan(inputs), {})
    if limit and shared:  # what train.sequence_parallel would buy on cards of the planned size
        outcome.notes.append(f"most frames per sample on cards of {limit:g} GiB: " + ", ".join(
            f"{plan['largest_frames_under_limit']} on " + ("1 card" if n == 1 else f"{n} cards sharing it")
            for n, plan in sorted(shared.items())) + " (train.sequence_parallel)")
    if limit and not cpu and str(results.device or "").startswith("cuda"):
        ax.axhline(limit, color="#C44E52", linestyle="-.", label=f"GPU memory limit ({limit:g} GiB)")
    ax.set_title(f"Peak memory per rank over steps vs the planner's prediction ({results.device or '?'})",
                 fontsize=12)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if cpu:
        ax.text(1.02, 0.0, CPU_NOTE, fontsize=8, transform=ax.transAxes, va="bottom", ha="left", color="#444444")
    if not results.predicted_gib:
        ax.text(0.99, 0.98, "no prediction recorded", fontsize=9, transform=ax.transAxes, ha="right", va="top")
    outcome.files.append(save(fig, out_dir, "memory", fmt))
    return outcome


def plot_peaks(ax, logs: dict[int, list[dict]], measured: dict[int, dict[str, float]]) -> bool:
    """Each rank's peaks over the steps, or, for a rank without a step log, its peaks over the run from
    the run record (at step 0); whether they are a CPU process's (RSS)."""
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    cpu = False
    for index, rank in enumerate(sorted(set(logs) | set(measured))):
        color = colors[index % len(colors)]
        for key, legend, style in MEMORY_KEYS:
            points = series(logs.get(rank, []), key)
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, style, marker="o", color=color, label=f"rank {rank} peak {legend}")
            elif not logs.get(rank) and key in measured.get(rank, {}):
                ax.plot([0], [measured[rank][key]], marker="s", linestyle="none", color=color,
                        label=f"rank {rank} peak {legend} (run record)")
            else:
                continue
            cpu = cpu or key == "peak_rss_gib"
    return cpu


def load_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    outcome = Outcome()
    results, train_missing = optional(lambda: read.train_results(inputs), TrainResults())
    verify, verify_missing = optional(lambda: read.verify_result(inputs))
    bars = [(LOAD_LABELS[key], seconds, "#4C72B0") for key, seconds in results.load_seconds.items()]
    if verify is not None and verify.load_seconds is not None:
        bars.append(("verify: load base + adapter (no DeepSpeed)", verify.load_seconds, "#55A868"))
    outcome.notes += [reason for reason in (train_missing, verify_missing) if reason]
    outcome.notes += results.kernel_warnings  # a slow path the run took unasked: said where its times are shown
    if not bars:
        raise Missing("; ".join(outcome.notes) or "no load times recorded")
    fig = new_figure(9.0, 1.6 + 0.6 * len(bars))
    ax = fig.add_subplot()
    labels, seconds, colors = zip(*bars)
    y = np.arange(len(bars))
    label_bars(ax, ax.barh(y, seconds, color=colors), fmt="{:.3g} s", horizontal=True)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.margins(x=0.2)
    summary = results.load_summary
    ax.set_title("Model load and load-verification times" + (f" ({summary})" if summary else ""), fontsize=12)
    if results.kernel_warnings:  # under the bars, in red: the times above were taken on it
        fig.text(0.01, 0.01, " ".join(results.kernel_warnings), fontsize=8, color="#B22222", wrap=True)
    outcome.files.append(save(fig, out_dir, "load", fmt))
    return outcome

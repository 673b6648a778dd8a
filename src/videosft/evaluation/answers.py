"""Greedy answers on val windows, scored the same way for the base model and the fine-tune.

The answer parser is :func:`videosft.encoding.chat.parse_answer`, the one the preprocess stage's format
comes from. An answer that does not parse scores zero (as lmms-eval's Charades task does); a
degenerate one (:func:`videosft.evaluation.generation.is_degenerate`: a token or a short run of tokens
repeated, or no end token within the budget) is counted as such too. Every metric is also
given for a lenient reading (:func:`videosft.encoding.chat.parse_answer_lenient`, prefixed ``lenient_``),
so that a model answering in prose is not scored zero for its wording, and beside the answers
of the models stand constant answers (:func:`constant_baselines`): what a model that ignores the
video scores on the same windows. :func:`gain_over_best_constant` says by how much, window by window,
the fine-tune beats the best of them, and how sure that is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from ..data.verify_result import COUNTS
from ..encoding.chat import parse_answer, parse_answer_lenient, prompt_of
from ..training.batches import made_ahead
from .generation import REPEATS, batch_answers, prompt_batch
from .metrics import WINDOW_METRIC_DEFINITIONS, r1_iou, score_text, window_metrics


def window_answers(model, rows: Sequence[dict], tokenizer, video_processor, max_new_tokens: int,
                   think_block: str = "prompt", batch_size: int = 1,
                   read_ahead: bool | None = None) -> tuple[list[dict], list[dict]]:
    """The base's (adapter disabled) and the fine-tune's greedy answers to each window
    (:func:`videosft.evaluation.generation.batch_answers`), with the raw text, whether and what they
    parse to, strictly and leniently, and whether they degenerate. ``batch_size`` windows at a time are
    read, made into one left-padded batch and answered by both, so each window is read once. With
    ``read_ahead`` (by default on a GPU) a host thread reads and makes the next batch while the model
    answers (two batches in memory at most); on a CPU the model's own threads use every core, and a
    thread beside them made a batch of one answer at half the speed (measured)."""
    def make(batch):
        return prompts_of(batch, tokenizer, video_processor)

    if read_ahead is None:
        read_ahead = next(model.parameters()).device.type == "cuda"
    batches = (rows[first:first + batch_size] for first in range(0, len(rows), batch_size))
    base, tuned = [], []
    for batch, prompts in made_ahead(batches, make) if read_ahead else map(make, batches):
        with model.disable_adapter():
            base += answered(batch, batch_answers(model, prompts, tokenizer, max_new_tokens, think_block))
        tuned += answered(batch, batch_answers(model, prompts, tokenizer, max_new_tokens, think_block))
    return base, tuned


def prompts_of(rows: Sequence[dict], tokenizer, video_processor) -> tuple[list[dict], dict]:
    """Windows read from the store (what they ask and what should be kept) and their prompts as one batch."""
    keys = ("window_id", "keep_local", "window_start", "window_end")
    read = list(rows)
    return [{key: row[key] for key in keys} for row in read], prompt_batch([prompt_of(row) for row in read],
                                                                          tokenizer, video_processor)


def answered(windows: list[dict], answers: list[dict]) -> list[dict]:
    return [{"window_id": window["window_id"], "text": answer["text"], "predicted": parse_answer(answer["answer"]),
             "lenient": parse_answer_lenient(answer["answer"]), "target": [tuple(r) for r in window["keep_local"]],
             "degenerate": answer["degenerate"], "window": (window["window_start"], window["window_end"])}
            for window, answer in zip(windows, answers, strict=True)]


def score(answers: list[dict]) -> dict:
    """Moment-retrieval metrics (fractions in [0, 1]) plus the rates of each kind of answer, for the
    strict reading and, prefixed ``lenient_``, the lenient one."""
    metrics = window_metrics({"predicted": a["predicted"], "target": a["target"]} for a in answers)
    lenient = window_metrics({"predicted": a["lenient"], "target": a["target"]} for a in answers)
    count = len(answers)
    unparseable = sum(a["predicted"] is None for a in answers)
    degenerate = sum(a["degenerate"] for a in answers)
    return {**metrics, "well_formed_rate": (count - unparseable) / count, "unparseable_rate": unparseable / count,
            "degenerate_rate": degenerate / count,
            **{f"lenient_{key}": value for key, value in lenient.items() if key not in COUNTS},
            "lenient_readable_rate": sum(a["lenient"] is not None for a in answers) / count}


# What the keys of score() beyond window_metrics' measure (see definition()).
ANSWER_DEFINITIONS = {
    "well_formed_rate": "share of answers in the answer format (ascending a-b ranges in seconds, or none)",
    "unparseable_rate": "share of answers not in the answer format; they score 0 (lower is better)",
    "degenerate_rate": f"share of answers that repeat a token or a run of up to 4 tokens {REPEATS} times in a row, "
                       "or do not end within verify.max_new_tokens (lower is better)",
    "lenient_readable_rate": "share of answers in which the lenient reading finds ranges or a none",
}


def definition(metric: str) -> str:
    """What a key of :func:`score` measures, for a report to put beside its value ("" if unknown)."""
    strict = metric.removeprefix("lenient_")
    if strict != metric and strict in WINDOW_METRIC_DEFINITIONS:
        return f"{strict} with every answer read leniently (ranges found anywhere in the text, also in prose)"
    return {**WINDOW_METRIC_DEFINITIONS, **ANSWER_DEFINITIONS}.get(metric, "")


STEP = 0.1  # the answer format's resolution: constant ranges are searched on it


def constant_answer(name: str, length: float, best_range: tuple[float, float]) -> list[tuple[float, float]]:
    """The ranges constant ``name`` answers on a window ``length`` seconds long."""
    return {"none": [], "whole_window": [(0.0, length)], "best_constant_range": [best_range]}[name]


def constant_baselines(rows: Iterable[dict]) -> dict:
    """What answering every window alike scores: "none", the whole window, and the single range
    (on the answer format's 0.1 s grid, within the shortest window) with the best mIoU."""
    facts = [([tuple(r) for r in row["keep_local"]], row["window_end"] - row["window_start"]) for row in rows]
    targets, lengths = [target for target, _ in facts], [length for _, length in facts]

    def scored(answers):
        return window_metrics({"predicted": answer, "target": target} for answer, target in zip(answers, targets))

    # the search ranks candidates by their mIoU alone (what window_metrics' mIoU sums), then scores the best fully
    moments = [target for target in targets if target]
    grid = [round(k * STEP, 1) for k in range(int(min(lengths) / STEP + 1e-9) + 1)]
    candidates = [(start, end) for start in grid for end in grid if end > start]
    best_range = max(candidates, key=lambda candidate: sum(r1_iou(candidate, target) for target in moments))
    scores = {name: scored([constant_answer(name, length, best_range) for length in lengths])
              for name in ("none", "whole_window", "best_constant_range")}
    return {**scores, "best_constant_range": {"range": list(best_range), **scores["best_constant_range"]}}


def gain_over_best_constant(answers: list[dict], baselines: dict) -> dict | None:
    """The fine-tune's IoU minus the best constant's (by mIoU) on the same window, over the windows with
    something to keep: the mean (which equals the difference of their mIoUs), its standard error (the
    gains' sample standard deviation over the square root of their count; None for one window) and the
    count. A mean several standard errors above zero is a gain that ignoring the video does not explain.
    None when no window has something to keep."""
    scored = {name: metrics for name, metrics in baselines.items() if metrics.get("mIoU") is not None}
    moments = [answer for answer in answers if answer["target"]]
    if not moments or not scored:
        return None
    best = max(scored, key=lambda name: scored[name]["mIoU"])
    best_range = tuple(baselines["best_constant_range"]["range"])

    def iou(ranges, target):  # R1: the first range answered
        return r1_iou(ranges[0], target) if ranges else 0.0

    gains = [iou(answer["predicted"], answer["target"])
             - iou(constant_answer(best, answer["window"][1] - answer["window"][0], best_range), answer["target"])
             for answer in moments]
    error = statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) > 1 else None
    return {"constant": best, "mean": statistics.fmean(gains), "standard_error": error, "windows": len(gains)}


def evaluate(model, rows: Sequence[dict], tokenizer, video_processor, max_new_tokens: int,
             think_block: str = "prompt", batch_size: int = 1) -> dict:
    """Base (adapter disabled) and fine-tuned answers on the same windows, scored alike, beside the
    constant answers' scores."""
    base, tuned = window_answers(model, rows, tokenizer, video_processor, max_new_tokens, think_block, batch_size)
    baselines = constant_baselines([{"keep_local": answer["target"], "window_start": answer["window"][0],
                                     "window_end": answer["window"][1]} for answer in base])
    return {"windows": len(rows), "base": score(base), "fine_tuned": score(tuned), "baselines": baselines,
            "gain_over_best_constant": gain_over_best_constant(tuned, baselines),
            "answers": [{"window_id": b["window_id"], "target": b["target"], "base": b["text"], "fine_tuned": t["text"]}
                        for b, t in zip(base, tuned)]}


def table(result: dict) -> str:
    """Base, fine-tune and the constant answers, metric by metric ("-" where a metric has no windows)."""
    baselines = result.get("baselines", {})
    columns = [("base", result["base"]), ("fine-tuned", result["fine_tuned"]),
               *((f"const {name}", metrics) for name, metrics in baselines.items())]
    keys = [k for k in result["base"] if k not in COUNTS]

    # each column as wide as its name and a space, so names never run together ("const whole_window")
    widths = [max(8, len(name)) + 2 for name, _ in columns]

    def cell(value, width):
        return f"{value:>{width}.3f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    first = result["base"]
    lines = [f"{first['moment_windows']} windows with something to keep (R1, mIoU, mAP), {first['empty_windows']} "
             "with nothing (empty_accuracy, false_keep_rate)",
             f"{'metric':<26}" + "".join(f"{name:>{width}}" for (name, _), width in zip(columns, widths))]
    lines += [f"{key:<26}" + "".join(cell(metrics.get(key), width) for (_, metrics), width in zip(columns, widths))
              for key in keys]
    if "best_constant_range" in baselines:
        start, end = baselines["best_constant_range"]["range"]
        lines.append(f"(const best_constant_range answers {start:.1f}-{end:.1f} everywhere)")
    if gain := result.get("gain_over_best_constant"):
        line = (f"fine-tuned IoU minus const {gain['constant']}'s, per window with something to keep "
                f"({gain['windows']}): {gain['mean']:+.3f}")
        if error := gain["standard_error"]:
            line += f" +- {error:.3f} standard error ({gain['mean'] / error:.1f} of them)"
        lines.append(line)
    return "\n".join(lines)


def headline(result: dict) -> str:
    """The evaluation in one line: the fine-tune's mIoU and R1@0.5 beside the base's, and the per-window
    gain over the best constant answer ("-" where no window has a moment)."""
    def value(metrics: dict, key: str) -> str:
        return score_text(metrics.get(key))

    tuned, base = result["fine_tuned"], result["base"]
    line = (f"on {result['windows']} val windows, fine-tuned mIoU {value(tuned, 'mIoU')} (base {value(base, 'mIoU')}), "
            f"R1@0.5 {value(tuned, 'R1@0.5')} (base {value(base, 'R1@0.5')})")
    if gain := result.get("gain_over_best_constant"):
        error = f"standard error {gain['standard_error']:.3f}, " if gain["standard_error"] else ""
        line += (f"; IoU gain over the best constant answer ({gain['constant']}) per window with a moment "
                 f"{gain['mean']:+.3f} ({error}{gain['windows']} windows)")
    return line

"""The evaluation's tables: ``evaluation.csv`` (per window, base against fine-tuned),
``evaluation_source_time.csv`` (the predict stage's cut lists) and ``evaluation.html`` with both,
every metric defined beside its value, and the answers per window."""

from __future__ import annotations

import csv
import html
from pathlib import Path
from typing import Any

from ..data.verify_result import WindowEvaluation
from ..evaluation.answers import definition
from ..evaluation.metrics import SOURCE_TIME_DEFINITIONS
from .evaluation import LOWER_IS_BETTER, SOURCE_TIME_COUNTS, SourceTime

TABLES = ("evaluation.html", "evaluation.csv", "evaluation_source_time.csv")
HEAD = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'><title>Evaluation</title>",
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}"
        "td,th{border:1px solid #bbb;padding:4px 10px}td.n{text-align:right;font-family:monospace}"
        "th{background:#eee}td.t{font-family:monospace;white-space:pre-wrap;max-width:40em}"
        "td.d{color:#444;max-width:40em}.better{color:#1a7f37}.worse{color:#c0392b}</style></head><body>"]


def write_tables(window: WindowEvaluation | None, reason: str | None, source: SourceTime, out_dir: Path) -> list[str]:
    """Every table, from the evaluation per window (None: ``reason`` says why there is none) and in source time."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = window.metrics if window else []
    write_csv(out_dir / "evaluation.csv", ["metric", "base", "fine_tuned", "difference", "definition"],
              [[name, cell(base), cell(tuned), cell(difference(base, tuned)), definition(name)]
               for name, base, tuned in rows])
    write_csv(out_dir / "evaluation_source_time.csv", ["metric", "value", "definition"],
              [[name, cell(value), SOURCE_TIME_DEFINITIONS.get(name, "")] for name, value in source.rows()])
    page = [*HEAD, *window_table(window, reason), *source_time_table(source),
            *(answers_table(window.answers) if rows else []), "</body></html>"]
    (out_dir / "evaluation.html").write_text("\n".join(page) + "\n")
    return [str(out_dir / name) for name in TABLES]


def cell(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def difference(base: float | None, tuned: float | None) -> float | None:
    return tuned - base if base is not None and tuned is not None else None


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def window_table(window: WindowEvaluation | None, reason: str | None) -> list[str]:
    parts = ["<h2>Evaluation per window: base vs fine-tuned</h2>"]
    if not (window and window.metrics):
        return parts + [f"<p>No evaluation to show: {html.escape(reason or 'the verify stage recorded no metrics')}</p>"]
    parts.append(f"<p>{html.escape(str(window.windows))} validation windows, greedy decoding, window-local time "
                 "(from the verify stage).</p>")
    if gain := window.gain:
        text = (f"Fine-tuned IoU minus that of the best constant answer ({gain['constant']}, the same answer on every "
                f"window), per window with something to keep ({gain['windows']}): mean {gain['mean']:+.4f}")
        if error := gain.get("standard_error"):
            text += (f", standard error {error:.4f} ({gain['mean'] / error:.1f} of them; three or more: a gain that "
                     "chance on these windows does not explain)")
        parts.append(f"<p>{html.escape(text)}.</p>")
    parts.append("<table><tr><th>metric</th><th>base</th><th>fine-tuned</th><th>difference</th>"
                 "<th>definition</th></tr>")
    for name, base, tuned in window.metrics:
        change = difference(base, tuned)
        css = "" if not change else " better" if (change < 0 if name in LOWER_IS_BETTER else change > 0) else " worse"
        parts.append(f"<tr><td>{html.escape(name)}</td><td class='n'>{cell(base)}</td><td class='n'>{cell(tuned)}"
                     f"</td><td class='n{css}'>{'' if change is None else f'{change:+.4f}'}</td>"
                     f"<td class='d'>{html.escape(definition(name))}</td></tr>")
    return parts + ["</table>"]


def source_time_table(source: SourceTime) -> list[str]:
    parts = ["<h2>Evaluation in source time: the cut lists</h2>"]
    if source.evaluation is None:
        return parts + [f"<p>No source-time evaluation to show: {html.escape(source.note)}</p>"]
    parts += [f"<p>{html.escape(source.note)}.</p>", "<table><tr><th>metric</th><th>value</th><th>definition</th></tr>"]
    for name, value in source.rows():
        shown = "-" if value is None else (f"{value:.1f}" if name.endswith("_seconds") else
                                           f"{value:g}" if name in SOURCE_TIME_COUNTS else f"{value:.4f}")
        parts.append(f"<tr><td>{html.escape(name)}</td><td class='n'>{shown}</td>"
                     f"<td class='d'>{html.escape(SOURCE_TIME_DEFINITIONS.get(name, ''))}</td></tr>")
    return parts + ["</table>"]


def answers_table(answers: list[dict]) -> list[str]:
    if not answers:
        return []
    parts = ["<h3>Answers per window</h3><table><tr><th>window</th><th>target</th><th>base</th>"
             "<th>fine-tuned</th></tr>"]
    for answer in answers:
        target = ", ".join(f"{s:.1f}-{e:.1f}" for s, e in answer.get("target") or []) or "none"
        texts = [html.escape(shown_answer(answer.get(key))) for key in ("base", "fine_tuned")]
        parts.append(f"<tr><td>{html.escape(str(answer.get('window_id')))}</td><td class='t'>{target}</td>"
                     f"<td class='t'>{texts[0]}</td><td class='t'>{texts[1]}</td></tr>")
    return parts + ["</table>"]


def shown_answer(text: Any, limit: int = 200) -> str:
    """A model answer as a reader can see it: control characters spelled out, long ones cut."""
    if text is None:
        return ""
    text = repr(str(text))[1:-1]
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"

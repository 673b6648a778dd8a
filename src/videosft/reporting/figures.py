"""Every figure of the report, in order, and :func:`make_report`, which draws them all: an absent
input, or a figure that fails, gives a placeholder that says why, never a crash."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Callable

from ..errors import InputError
from .drawing import Outcome, placeholder
from .evaluation import evaluation_chart, source_time, window_evaluation
from .inputs import Inputs, Missing
from .tables import TABLES, write_tables
from .tokens import tokens_figure
from .train_run import load_figure, loss_figure, memory_figure
from .windows import windows_figure


def evaluation_figure(inputs: Inputs, out_dir: Path, fmt: str) -> Outcome:
    """The evaluation chart and, whatever it shows, the tables."""
    window, reason = window_evaluation(inputs)
    source = source_time(inputs)
    tables = write_tables(window, reason, source, out_dir)
    return Outcome(files=[evaluation_chart(window, reason, source, out_dir, fmt), *tables])


BUILDERS: dict[str, tuple[str, Callable[[Inputs, Path, str], Outcome]]] = {
    "windows": ("Windows per split and rejects per reason", windows_figure),
    "tokens": ("Per-sample frames and tokens", tokens_figure),
    "loss": ("Training loss per rank", loss_figure),
    "memory": ("Peak memory per rank vs the planner's prediction", memory_figure),
    "load": ("Model load and load-verification times", load_figure),
    "evaluation": ("Evaluation: base vs fine-tuned", evaluation_figure),
}
FIGURES = tuple(BUILDERS)


def draw(name: str, inputs: Inputs, out_dir: Path, fmt: str) -> tuple[Outcome, str | None]:
    """One figure, or its placeholder; and the problem, if drawing it failed."""
    title, build = BUILDERS[name]
    problem = None
    try:
        outcome = build(inputs, out_dir, fmt)
    except Missing as missing:
        outcome = Outcome(placeholder=str(missing))
    except InputError as error:  # a damaged input: its message says which file and what to do
        outcome = Outcome(placeholder=str(error))
        problem = f"{name}: {error}"
    except Exception as error:  # a figure that cannot be drawn must not hide the others
        traceback.print_exc()
        outcome = Outcome(placeholder=f"could not draw: {type(error).__name__}: {error}")
        problem = f"{name}: {type(error).__name__}: {error}"
    if outcome.placeholder is not None:
        outcome.files = [placeholder(out_dir, name, title, outcome.placeholder, fmt)] + \
            [f for f in outcome.files if not f.endswith(f"{name}.{fmt}")]
    if name == "evaluation" and not all((out_dir / table).exists() for table in TABLES):
        outcome.files += write_tables(None, outcome.placeholder, source_time(inputs), out_dir)
    return outcome, problem


def make_report(inputs: Inputs, out_dir: Path, fmt: str = "png") -> dict:
    """Draw every figure into ``out_dir``: the report stage's results (what each figure shows or why
    it is a placeholder, the inputs, the source-time evaluation's state, the problems)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, dict] = {}
    problems = []
    for name in FIGURES:
        outcome, problem = draw(name, inputs, out_dir, fmt)
        problems += [problem] if problem else []
        figures[name] = {"files": outcome.files, "placeholder": outcome.placeholder, "notes": outcome.notes}
        state = f"placeholder ({outcome.placeholder})" if outcome.placeholder else "ok"
        print(f"report: {name}: {state}; " + ", ".join(Path(f).name for f in outcome.files), flush=True)
    source = source_time(inputs)
    print(f"report: source-time evaluation: {'shown' if source.evaluation else 'none'} ({source.note})", flush=True)
    return {"figures": figures, "inputs": inputs.described(), "format": fmt,
            "source_time": {"shown": source.evaluation is not None, "note": source.note},
            "placeholders": sorted(n for n, f in figures.items() if f["placeholder"]), "problems": problems}

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
and the run record lists which figures are placeholders and why. The phases: :func:`parse_args`,
:func:`gather_inputs` and :func:`report`; the figures and tables are drawn by :mod:`videosft.reporting`.

    python -m videosft.stages.report --config config.yaml --results results --out results/report
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import config as config_lib
from ..provenance import exit_after, run_record, stage_parser
from ..reporting import FIGURES, Inputs, make_report

INPUTS = (  # option, what it reads
    ("windows", "windows.parquet of the window stage"),
    ("window-rejects", "rejects.jsonl of the window stage"),
    ("manifest", "manifest.json of the preprocess stage"),
    ("preprocess-rejects", "rejects.jsonl of the preprocess stage"),
    ("probe", "probe.json of the probe stage"),
    ("train", "run_record.json of the train stage"),
    ("train-steps", "steps.jsonl of the train stage: every rank's step log"),
    ("verify", "verify.json of the verify stage"),
    ("predict", "summary.json of the predict stage (scored in source time when it predicted the val split)"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    parser.add_argument("--results", type=Path, help="the workflow's results directory: every input below at its "
                        "usual place (the options below override single inputs)")
    for name, help_text in INPUTS:
        parser.add_argument(f"--{name}", type=Path, help=help_text)
    parser.add_argument("--format", choices=("png", "svg"), default="png", help="figure file format (default png)")
    return parser.parse_args(argv)


def gather_inputs(args: argparse.Namespace) -> Inputs:
    """Every input at its usual place under ``--results`` (or none), each option overriding its one."""
    inputs = Inputs.under(args.results) if args.results else Inputs()
    for name in vars(inputs):
        if getattr(args, name) is not None:
            setattr(inputs, name, getattr(args, name))
    return inputs


def report(inputs: Inputs, out: Path, fmt: str, record: dict) -> None:
    record["results"] = make_report(inputs, out, fmt)
    placeholders = record["results"]["placeholders"]
    print(f"report: {len(FIGURES)} figures in {out}"
          + (f", {len(placeholders)} without data: {', '.join(placeholders)}" if placeholders else ""))
    for warning in {note for figure in record["results"]["figures"].values() for note in figure["notes"]
                    if note.startswith("WARNING")}:
        print(warning, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_lib.load(args.config, "report")
    inputs = gather_inputs(args)
    with run_record("report", args.out, cfg, args) as record:
        report(inputs, args.out, args.format, record)
    return 0


if __name__ == "__main__":
    exit_after(main)

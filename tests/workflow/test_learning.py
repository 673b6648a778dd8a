"""Training learns: the whole pipeline takes a tiny model from zero to grounding windows it never saw.

This is the end-to-end check that timestamps, labels, masking, budgets and adapters line up: the
answers are known (the demo draws the ball's intervals), the base scores zero on them, and only a
fine-tune that sees the windows on the clock its answers use, is supervised on those answers and
is reloaded with its adapter can score well on other videos' windows.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest

from conftest import copy_checkout, snakemake

pytestmark = pytest.mark.slow
# The fine-tune must beat the best constant answer (what ignoring the video scores) on the same windows
# with a moment, window by window: the mean of its IoU minus the constant's at least Z standard errors of
# that mean (one-sided p < 0.0014 that a model no better than the constant gains as much) and at least
# GAIN, a floor in case the gains' spread were ever small. The pipeline repeats itself: two runs of one
# commit at once on two cores trained the same adapter bit for bit (2026-12-02). It did not while the
# demo's videos were encoded with x264's AVX-512 code, which gave other pixels under load: five runs
# of nearby commits gained 0.184 to 0.232, and well-formed answers ranged from 0.78 (CI failed on it)
# to 0.99. Any change to a stage draws a new run, so the bars are set for that spread: per-window
# gains spread about 0.44, a standard error of 0.045. Measured since (seed 0, 94 windows with a
# moment): gain 0.265 (5.8 standard errors), R1@0.5 0.745, well-formed 0.926, "none" on every empty
# window. Over five seeds before the split by source video: +0.24 to +0.46 wherever the base
# pretrained (bench/RESULTS.md).
GAIN = 0.1
Z = 3.0
WARNING = re.compile(r"warn", re.IGNORECASE)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The learning config's whole pipeline, as a user runs it."""
    workdir = copy_checkout(tmp_path_factory.mktemp("learning"))
    result = snakemake(workdir, "--cores", "2", "--configfile", "workflow/configs/learning.yaml", timeout=1800)
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((workdir / "logs").rglob("*.log")))
    assert result.returncode == 0, result.stderr[-3000:] + logs
    return workdir


def test_the_train_log_holds_no_warning_twice_over_its_steps(workdir):
    """200 steps of progress lines and real problems: the warnings nobody can act on, repeated every step
    before, are silenced once at the start and named in the run record."""
    log = (workdir / "logs" / "train" / "train.log").read_text().splitlines()
    record = json.loads((workdir / "results" / "train" / "run_record.json").read_text())
    assert record["results"]["steps"] >= 50
    warnings = Counter(line for line in log if WARNING.search(line))
    assert not {line: count for line, count in warnings.items() if count > 2}, warnings  # once per rank at most
    assert sum(warnings.values()) <= 6, warnings  # a handful at start-up, none per step
    assert any("collectives DeepSpeed" in why for why in record["quieted_warnings"])


def test_the_fine_tune_learns_to_ground_windows_of_videos_it_never_saw(workdir):

    pretraining = json.loads((workdir / "data/demo/demo.json").read_text())["model"]["pretraining"]
    assert pretraining["held_out_exact_match"] >= 0.5, pretraining

    evaluation = json.loads((workdir / "results/verify/verify.json").read_text())["evaluation"]
    manifest = json.loads((workdir / "results/preprocess/manifest.json").read_text())
    assert evaluation["windows"] == manifest["samples"]["val"] >= 50  # every val window
    base, tuned, constants = evaluation["base"], evaluation["fine_tuned"], evaluation["baselines"]
    summary = json.dumps({"base": base, "fine_tuned": tuned, "baselines": constants}, indent=1)
    # the pretrained base answers with marker times, never ranges, read strictly or leniently
    assert base["mIoU"] <= 0.05 and base["lenient_mIoU"] <= 0.05, summary
    gain, best_constant = evaluation["gain_over_best_constant"], max(m["mIoU"] for m in constants.values())
    assert gain["windows"] == tuned["moment_windows"] and constants[gain["constant"]]["mIoU"] == best_constant
    assert math.isclose(gain["mean"], tuned["mIoU"] - best_constant, abs_tol=1e-9)  # the mean of per-window gains
    assert gain["mean"] >= max(GAIN, Z * gain["standard_error"]), \
        f"gain {gain['mean']:.3f}, standard error {gain['standard_error']:.3f}\n{summary}"
    assert tuned["R1@0.5"] >= 0.5 and tuned["well_formed_rate"] >= 0.8, summary
    assert tuned["empty_accuracy"] >= constants["whole_window"]["empty_accuracy"], summary  # answers "none" too

    # "windows it never trained on": no val window, nor any window of a val video, was a train batch
    trained = {json.loads(line)["window_id"]
               for ledger in (workdir / "results/train").glob("ledger.rank*.jsonl")
               for line in ledger.read_text().splitlines()}
    evaluated = {answer["window_id"] for answer in evaluation["answers"]}
    video = lambda window_id: window_id.split("#")[0]  # noqa: E731
    assert trained and evaluated and not {video(w) for w in trained} & {video(w) for w in evaluated}


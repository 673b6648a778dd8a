"""bench/compare_trees.py: run names (a pair run twice keeps both figures), a stuck run stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from compare_trees import parse_run, run_labels  # noqa: E402


def test_a_run_repeated_keeps_every_figure_under_its_own_key():
    runs = [parse_run(text) for text in ["this:ours", "old:ours", "this:ours", "old:ours+profile", "old:ours"]]
    assert run_labels(runs) == ["this:ours", "old:ours", "this:ours #2", "old:ours+profile", "old:ours #2"]


def test_run_options():
    run = parse_run("old:ours+profile+env:VIDEOSFT_AUTOTUNE=full")
    assert (run["tree"], run["trainer"], run["profile"], run["env"]) == ("old", "ours", True,
                                                                       {"VIDEOSFT_AUTOTUNE": "full"})
    with pytest.raises(SystemExit, match="unknown option 'fast'"):
        parse_run("old:ours+fast")


# A tree whose bench outlasts any limit, as 4488029's did building its samples and autotuning in a
# 600 s call (2026-12-05): it starts a child in a session of its own, as torchrun starts its ranks, and both wait.
STUCK_BENCH = """\
import subprocess, sys, time
TRAINERS = {"ours": {}}
def main():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open("child.pid", "w").write(str(child.pid))
    print("building samples", flush=True)
    time.sleep(600)
"""


def test_a_run_past_its_timeout_is_stopped_with_what_it_started_and_the_next_run_goes_on(tmp_path):
    stuck = tmp_path / "stuck"
    (stuck / "bench" / "configs").mkdir(parents=True)
    (stuck / "bench" / "train_throughput.py").write_text(STUCK_BENCH)
    (stuck / "bench" / "configs" / "Qwen3.5-4B.json").write_text("{}")
    out = tmp_path / "out"
    started = time.monotonic()
    shown = subprocess.run([sys.executable, str(BENCH / "compare_trees.py"), "--tree", f"old={stuck}",
                            "--runs", "old:ours", "old:ours", "--run-timeout", "3", "--out", str(out)],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert shown.returncode == 0, shown.stderr
    assert time.monotonic() - started < 60
    results = json.loads((out / "compare_trees.json").read_text())
    assert list(results) == ["old:ours", "old:ours #2"]  # the second run ran after the first was stopped
    for figures in results.values():
        assert figures["failed"].startswith("stopped after 3 s (--run-timeout)"), figures
        assert "building samples" in figures["failed"]
        assert 3 <= figures["wall_seconds"] < 30
    child = int((stuck / "child.pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, \
        "the run's own child outlived it"

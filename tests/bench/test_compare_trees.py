"""bench/compare_trees.py's run names: a pair run twice keeps both figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

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

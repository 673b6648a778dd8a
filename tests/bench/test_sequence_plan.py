"""bench/sequence_plan.py (the planner's figures for train.sequence_parallel in bench/RESULTS.md) runs
against today's library, and more cards per sample hold more frames."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_plan_table_is_printed_and_more_cards_hold_more_frames():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sequence_plan.py"), "--frames", "256", "--sizes",
                           "1", "2", "4"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if re.match(r"\| 256 \|", line)]
    assert [int(row[2]) for row in rows] == [1, 2, 4]
    reserved = [float(row[3]) for row in rows]
    most = [int(row[8]) for row in rows]
    assert reserved[0] > reserved[1] > reserved[2] and most[0] < most[1] < most[2]

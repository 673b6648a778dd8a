"""bench/frame_decoding.py runs (on tiny frames): its figures are the launching thread's pace beside each
way of decoding, and a decode's latency, for every way it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts torch twice (the bench and its worker process)

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_measures_each_way_of_decoding():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "frame_decoding.py"), "--frames", "4", "--size", "32",
                           "--processes", "1", "--seconds", "0.2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[0])
    assert [row["decoding"] for row in result["rows"]] == ["none", "in a thread", "1 worker process(es)"]
    assert all(row["loop_rate"] > 0 for row in result["rows"]) and result["rows"][0]["relative"] == 1.0
    assert all(row["decode_s"] > 0 for row in result["rows"][1:])

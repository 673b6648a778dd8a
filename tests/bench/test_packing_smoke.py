"""bench/packing.py's CPU smoke run: the packed-batch benchmark the performance guard runs on a GPU
still runs against today's library (it broke unnoticed once, when the config became typed views)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_packed_mode_runs_on_a_tiny_model_and_its_first_pack_equals_its_samples():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "packing.py"), "--device", "cpu", "--modes", "packed",
                           "--memory-cap-gib", "12",  # a GPU card's size: nothing to cap on the CPU
                           "--no-results"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-1]
    assert result["mode"] == "packed" and result["micro_batches"] >= 1 and result["tokens_per_second"] > 0
    same = next(line for line in done.stdout.splitlines() if line.startswith("first pack vs its samples alone"))
    differences = json.loads(same.split(": ", 1)[1].replace("'", '"'))["max_relative_difference_per_sample"]
    assert len(differences) >= 2 and max(differences) < 1e-6

"""bench/packing.py's CPU smoke run: the packed-batch benchmark the performance guard runs on a GPU
still runs against today's library (it broke unnoticed once, when the config became typed views)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import packing  # noqa: E402
from videosft.kernels import attention_backends  # noqa: E402


@pytest.mark.slow
def test_the_packed_mode_runs_on_a_tiny_model_and_its_first_pack_equals_its_samples():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "packing.py"), "--device", "cpu", "--modes", "packed",
                           "--memory-cap-gib", "12",  # a GPU card's size: nothing to cap on the CPU
                           "--no-results"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-1]
    assert result["mode"] == "packed" and result["micro_batches"] >= 1 and result["tokens_per_second"] > 0
    steps = result["steps"]  # every timed step, adding up to the mode's figure
    assert len(steps) == result["micro_batches"]
    made = int(next(line for line in done.stdout.splitlines() if " samples of " in line).split()[0])
    assert result["samples"] == made  # the timed pass is a whole epoch: the first pass was the warm-up
    assert abs(sum(s["tokens"] for s in steps) / sum(s["seconds"] for s in steps) / result["tokens_per_second"] - 1) < 0.01
    assert all(s["autotuned"] == 0 and s["new_buckets"] == 0 and s["reserved_gib_added"] == 0 for s in steps)  # CPU
    same = next(line for line in done.stdout.splitlines() if line.startswith("first pack vs its samples alone"))
    differences = json.loads(same.split(": ", 1)[1].replace("'", '"'))["max_relative_difference_per_sample"]
    assert len(differences) >= 2 and max(differences) < 1e-6


def test_a_step_names_the_attention_buckets_it_met_first(monkeypatch):
    """With cuDNN's buckets on (a Hopper GPU), a step counts the buckets of its samples that no step before
    it met: 300 and 310 tokens share the 512 bucket, 700 does not."""
    monkeypatch.setitem(attention_backends._buckets, "on", True)
    rows = [{"input_tokens": n} for n in (300, 310, 700, 300)]
    events = packing.StepEvents(torch.device("cpu"), rows)
    found = []
    for indices in ([0], [1, 2], [3]):
        events.start()
        found.append(events.end(indices))
    assert [f["new_buckets"] for f in found] == [1, 1, 0]
    assert all(f["autotuned"] == 0 and f["reserved_gib_added"] == 0 for f in found)


def test_a_warm_up_count_is_refused_where_a_whole_pass_is_the_warm_up(capsys):
    with pytest.raises(SystemExit) as stopped:
        packing.main(["--device", "cpu", "--warmup", "3", "--no-results"])
    assert stopped.value.code == 2 and "give it with --passes 1" in capsys.readouterr().err

"""The train log stays readable over many steps: progress lines and real problems, no repeated warnings."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from conftest import run_torchrun
from test_train_policies import record_of, train_args, with_train

pytestmark = pytest.mark.slow

STEPS = 50
WARNING = re.compile(r"warn", re.IGNORECASE)


def test_fifty_steps_log_no_warning_twice_and_the_record_names_what_was_silenced(prepared, demo_config, tmp_path):
    out = tmp_path / "train"
    result = run_torchrun(train_args(with_train(demo_config, steps=STEPS), prepared / "preprocess" / "manifest.json",
                                     prepared, out))
    record = record_of(out)
    assert record["status"] == "ok", result.stdout[-3000:]
    warnings = Counter(line for line in result.stdout.splitlines() if WARNING.search(line))
    repeated = {line: count for line, count in warnings.items() if count > 2}  # once per rank at most
    assert not repeated, repeated
    assert sum(warnings.values()) <= 6, warnings  # a handful at start-up, none per step
    assert any("collectives DeepSpeed" in why for why in record["quieted_warnings"])
    steps = [json.loads(line) for line in (out / "steps.rank0.jsonl").read_text().splitlines()]
    assert len(steps) == STEPS

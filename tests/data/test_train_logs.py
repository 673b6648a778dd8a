"""The train stage's step logs: every rank's entries gathered into the one declared ``steps.jsonl``."""

from __future__ import annotations

import json

import pytest

from videosft.data import train_logs


def test_every_ranks_steps_are_gathered_into_one_file_and_read_back_per_rank(tmp_path):
    for rank in (0, 1):
        lines = [json.dumps({"step": step, "rank": rank, "loss": 5.0 - step - rank / 10}) for step in range(3)]
        train_logs.steps_path(tmp_path, rank).write_text("\n".join(lines) + "\n")
    path = train_logs.write_all_steps(tmp_path)
    assert path == tmp_path / "steps.jsonl"
    assert train_logs.read_all_steps(path) == train_logs.read_steps(tmp_path)
    assert [len(entries) for entries in train_logs.read_all_steps(path).values()] == [3, 3]

    train_logs.clear(tmp_path)  # a fresh run: no earlier run's steps, per rank or gathered
    assert not list(tmp_path.glob("steps*.jsonl"))


def test_a_run_without_steps_gathers_an_empty_file(tmp_path):
    assert train_logs.read_all_steps(train_logs.write_all_steps(tmp_path)) == {}


def test_a_damaged_line_is_named_with_its_file_and_what_to_do(tmp_path):
    from videosft.errors import InputError

    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 0, "rank": 0}\n{"step": 1, "ra\n')
    with pytest.raises(InputError, match=r"steps.jsonl, line 2: not a JSON entry .*snakemake --forcerun train"):
        train_logs.read_all_steps(path)

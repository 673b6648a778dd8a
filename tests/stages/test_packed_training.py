"""Packed batches (train.pack_tokens) through the real train stage: 2 CPU ranks under ZeRO-3."""

from __future__ import annotations

import json

import pytest

from safetensors.torch import load_file

from conftest import run_torchrun
from test_train_policies import DIE_WHILE_SAVING, record_of, train_args, with_train
from videosft import config as config_lib
from videosft.errors import ConfigError
from videosft.data.sample_store import read_samples
from videosft.training.setup import check_packing

pytestmark = pytest.mark.slow  # trains on 2 ranks


def test_packed_training_reads_every_sample_and_a_killed_run_resumes_exactly(prepared, demo_config, tmp_path):
    """Two ranks run the same number of packs under the budget, the ledgers cover the split; the
    cursor of a packed schedule counts samples, and resumed it finds the next pack (past an epoch's
    end): adapter, losses and ledgers equal those of the run never stopped."""
    manifest = prepared / "preprocess" / "manifest.json"
    rows = read_samples(manifest, "train")
    budget = 2 * max(row["input_tokens"] for row in rows) + 1  # at least two samples in every pack
    steps = max(6, -(-len(rows) // 4) + 2)  # past a checkpoint at step 4 and an epoch's end
    cfg = with_train(demo_config, pack_tokens=budget, steps=steps, save_every=2)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_torchrun(train_args(cfg, manifest, prepared, straight))
    results = record_of(straight)["results"]
    assert results["ledger"]["finished_epochs"] >= 1 and results["ledger"]["every_sample_read_in_each_finished_epoch"]
    logs = [[json.loads(line) for line in (straight / f"steps.rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [len(log) for log in logs] == [steps, steps]  # the same number of micro-batches on both ranks
    packs = [entry["input_tokens"] for log in logs for entry in log]
    assert all(sum(pack) <= budget for pack in packs) and max(len(pack) for pack in packs) >= 2
    read = [json.loads(l)["window_id"] for r in (0, 1) for l in (straight / f"ledger.rank{r}.jsonl").read_text().splitlines()]
    assert set(read) == {row["window_id"] for row in rows}
    assert results["lora_unchanged_after_two_steps"] == []

    script = tmp_path / "die_while_saving.py"
    script.write_text(DIE_WHILE_SAVING)
    killed = run_torchrun([str(script), "step-4", *train_args(cfg, manifest, prepared, interrupted)[2:]])
    assert killed.returncode != 0 and (interrupted / "checkpoints" / "latest").read_text() == "step-2"
    run_torchrun(train_args(cfg, manifest, prepared, interrupted, "--resume"))
    resumed = record_of(interrupted)["results"]
    assert resumed["resumed_from_step"] == 2 and resumed["ledger"] == results["ledger"]
    ours, theirs = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (interrupted, straight))
    assert ours.keys() == theirs.keys() and all(ours[key].equal(theirs[key]) for key in ours)
    assert resumed["losses_rank0"] == results["losses_rank0"]
    for rank in (0, 1):
        assert (interrupted / f"ledger.rank{rank}.jsonl").read_text() == (straight / f"ledger.rank{rank}.jsonl").read_text()


def test_a_sample_longer_than_the_pack_budget_stops_the_run_naming_it(prepared, demo_config, tmp_path):
    manifest = prepared / "preprocess" / "manifest.json"
    longest = max(read_samples(manifest, "train"), key=lambda row: row["input_tokens"])
    budget = longest["input_tokens"] - 1
    # checked on every rank before the model is built: one rank shows it as well as two, in one process's time
    result = run_torchrun(train_args(with_train(demo_config, pack_tokens=budget), manifest, prepared, tmp_path / "o"),
                          nproc=1, timeout=300)
    assert result.returncode != 0
    assert f"error: train.pack_tokens={budget} is less than the length of" in result.stdout  # the user's error, no bug
    assert f"{longest['window_id']} ({longest['input_tokens']} tokens)" in result.stdout


@pytest.mark.parametrize("options, message", [({"micro_batch_size": 2}, "set train.micro_batch_size: 1"),
                                              ({"tail": "error"}, "set train.tail to pad or drop")])
def test_options_packing_cannot_work_with_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        check_packing(config_lib.section("train", {"pack_tokens": 4096, "micro_batch_size": 1, "tail": "pad",
                                                   **options}))
    check_packing(config_lib.section("train", {"pack_tokens": None, "micro_batch_size": 2, "tail": "error"}))  # off

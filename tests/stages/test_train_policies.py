"""The train stage's guarantees on 2 CPU ranks: tail policies and their ledgers, smoke mode,
bit-exact resume after a kill, and a dead rank failing the run promptly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from conftest import PROJECT, remember_output, run_torchrun, stage_json
from processes import kill_tree
from videosft.data.sample_store import sample_files

pytestmark = pytest.mark.slow  # trains on 2 ranks


def manifest_with(prepared: Path, tmp_path: Path, count: int) -> Path:
    """A manifest whose train split holds the first ``count`` train samples."""
    manifest = json.loads((prepared / "preprocess" / "manifest.json").read_text())
    tables = [pq.read_table(path) for path in sample_files(prepared / "preprocess" / "manifest.json", "train")]
    rows = [row for table in tables for row in table.to_pylist()][:count]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows, schema=tables[0].schema), tmp_path / "train-00000.parquet")
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({**manifest, "files": {"train": ["train-00000.parquet"]}}))
    return path


def train_args(cfg: dict, samples: Path, prepared: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples", str(samples),
            "--probe", str(prepared / "probe" / "probe.json"), "--out", str(out), *extra]


def with_train(demo_config: dict, **train) -> dict:
    return {**demo_config, "train": {**demo_config["train"], **train}}


def record_of(out: Path) -> dict:
    assert (out / "run_record.json").exists()
    return json.loads((out / "run_record.json").read_text())


@pytest.mark.parametrize("tail, steps, padded, dropped", [("pad", 4, 1, 0), ("drop", 3, 0, 1)])
def test_tail_policies_are_explicit_and_the_ledger_proves_it(prepared, demo_config, tmp_path, tail, steps, padded,
                                                              dropped):
    samples = manifest_with(prepared, tmp_path, 7)  # 7 samples, 2 ranks: one too many or one too few
    out = tmp_path / "out"
    run_torchrun(train_args(with_train(demo_config, tail=tail, steps=steps), samples, prepared, out))
    ledger = record_of(out)["results"]["ledger"]
    assert ledger["finished_epochs"] == 1 and ledger["every_sample_read_in_each_finished_epoch"]
    assert len(ledger["padded_repeats"]) == padded and len(ledger["dropped"]) == dropped
    read = [json.loads(l)["window_id"] for r in (0, 1) for l in (out / f"ledger.rank{r}.jsonl").read_text().splitlines()]
    assert len(set(read)) == 7 - dropped and len(read) == 7 + padded - dropped


def test_tail_policy_error_stops_before_training(prepared, demo_config, tmp_path):
    samples = manifest_with(prepared, tmp_path, 7)
    result = run_torchrun(train_args(with_train(demo_config, tail="error"), samples, prepared, tmp_path / "out"),
                          timeout=300)
    assert result.returncode != 0
    assert "7 train samples do not divide into world size 2 x micro batch 1" in result.stdout


def test_smoke_mode_gives_every_rank_the_one_sample(prepared, demo_config, tmp_path):
    samples = manifest_with(prepared, tmp_path, 1)
    out = tmp_path / "out"
    run_torchrun(train_args(with_train(demo_config, smoke=True, steps=2), samples, prepared, out))
    results = record_of(out)["results"]
    assert results["ledger"]["smoke"] and results["ledger"]["consumed_per_rank"] == {"0": 2, "1": 2}
    ids = {json.loads(l)["window_id"] for r in (0, 1) for l in (out / f"ledger.rank{r}.jsonl").read_text().splitlines()}
    assert len(ids) == 1


# Runs the train stage as torchrun starts it, but every rank dies (as under a kill) at the worst
# moment of saving the checkpoint of step KILL_AT: DeepSpeed's files are written, the ranks' data
# positions and the `latest` marker not yet.
DIE_WHILE_SAVING = """
import os, sys
from pathlib import Path
import videosft.stages.train as train
import videosft.training.resume as resume

KILL_AT = sys.argv.pop(1)
write_json = resume.write_json

def dying_write_json(path, payload):
    if Path(path).name.startswith("position.") and Path(path).parent.name == KILL_AT:
        os._exit(9)
    write_json(path, payload)

resume.write_json = dying_write_json
sys.exit(train.main())
"""


def test_a_kill_while_saving_resumes_from_the_checkpoint_before_with_the_same_adapter(prepared, demo_config,
                                                                                      tmp_path):
    cfg = with_train(demo_config, steps=6, grad_accum=2, save_every=2)  # killed while saving step 4's checkpoint
    samples = prepared / "preprocess" / "manifest.json"
    straight = tmp_path / "straight"
    run_torchrun(train_args(cfg, samples, prepared, straight))
    assert (straight / "adapter" / "adapter_model.safetensors").exists()

    interrupted = tmp_path / "interrupted"
    script = tmp_path / "die_while_saving.py"
    script.write_text(DIE_WHILE_SAVING)
    killed = run_torchrun([str(script), "step-4", *train_args(cfg, samples, prepared, interrupted)[2:]])
    assert killed.returncode != 0 and not (interrupted / "adapter").exists()
    checkpoints = interrupted / "checkpoints"
    assert (checkpoints / "step-4").is_dir() and not list((checkpoints / "step-4").glob("position.*"))
    assert (checkpoints / "latest").read_text() == "step-2"  # the half-saved checkpoint never became latest

    run_torchrun(train_args(cfg, samples, prepared, interrupted, "--resume"))
    results = record_of(interrupted)["results"]
    assert results["resumed_from_step"] == 2
    ours = load_file(interrupted / "adapter" / "adapter_model.safetensors")
    theirs = load_file(straight / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].equal(theirs[key]), key
    assert results["losses_rank0"] == record_of(straight)["results"]["losses_rank0"]

    # resuming on other data is refused, naming what changed
    other = run_torchrun(train_args(cfg, manifest_with(prepared, tmp_path, 7), prepared, interrupted, "--resume"))
    assert other.returncode != 0 and "was made with another sample store" in other.stdout
    saved = json.loads((checkpoints / (checkpoints / "latest").read_text() / "identity.json").read_text())
    assert saved["world_size"] == 2 and len(saved["samples"]) == 1 + len(sample_files(samples, "train"))


def test_resuming_with_another_config_samples_or_world_size_is_refused_by_name(tmp_path):
    from videosft.errors import InputError
    from videosft.training.resume import check_identity

    saved = {"config_sha256": "a", "samples": ["1 files, sha256 x"], "world_size": 2}
    check_identity(saved, dict(saved), tmp_path)
    with pytest.raises(InputError, match="made with another world size; resume with"):
        check_identity(saved, {**saved, "world_size": 1}, tmp_path)
    with pytest.raises(InputError, match="another configuration .* and another sample store"):
        check_identity(saved, {**saved, "config_sha256": "b", "samples": ["2 files"]}, tmp_path)


def test_a_dead_rank_fails_the_run_promptly(prepared, demo_config, tmp_path):
    out = tmp_path / "out"
    cfg = with_train(demo_config, steps=400, timeout_s=20)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               *train_args(cfg, prepared / "preprocess" / "manifest.json", prepared, out)]
    process = subprocess.Popen(command, cwd=PROJECT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = out / "steps.rank1.jsonl"
        deadline = time.time() + 240
        while (not log.exists() or len(log.read_text().splitlines()) < 2) and time.time() < deadline:
            time.sleep(0.1)
        rank1 = next(child for child in psutil.Process(process.pid).children()
                     if child.environ().get("RANK") == "1")
        rank1.kill()
        killed = time.time()
        output, _ = process.communicate(timeout=90)
        remember_output(command, output)
        assert time.time() - killed < 60
    finally:
        kill_tree(process)
    assert process.returncode != 0
    assert "rank      : 1" in output or "local_rank: 1" in output, output[-3000:]
    assert not (out / "adapter").exists()


def test_two_nodes_through_the_slurm_launcher_train_like_one_node(prepared, demo_config, tmp_path):
    """The multi-node path for real on one machine: two torchrun agents (one process each) meeting
    through workflow/scripts/torchrun-slurm.sh, as `srun --ntasks-per-node=1` starts them, give the
    adapter that one agent with two processes gives, bit for bit."""
    import socket

    samples = prepared / "preprocess" / "manifest.json"
    single = tmp_path / "single"
    run_torchrun(train_args(demo_config, samples, prepared, single))

    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    nodes = tmp_path / "nodes"
    common = {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
              "SLURM_JOB_ID": "777", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
              "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost"}
    launcher = PROJECT / "workflow" / "scripts" / "torchrun-slurm.sh"
    agents = [subprocess.Popen([str(launcher), "1", *train_args(demo_config, samples, prepared, nodes)], cwd=PROJECT,
                               env={**common, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for node in (1, 0)]
    try:
        outputs = [agent.communicate(timeout=600)[0] for agent in agents]
        for node, output in zip((1, 0), outputs):
            remember_output([f"torchrun-slurm.sh agent of node {node}"], output)
    finally:
        for agent in agents:
            kill_tree(agent)
    results = record_of(nodes)["results"]
    assert results["world_size"] == 2, outputs
    ours = load_file(nodes / "adapter" / "adapter_model.safetensors")
    theirs = load_file(single / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    assert results["losses_rank0"] == record_of(single)["results"]["losses_rank0"]

"""A user's mistake ends a stage with its message, what to do and a non-zero exit, never a Python
traceback; VIDEOSFT_DEBUG=1 shows the traceback. Each error class, from the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT, remember_output, run_torchrun, stage_json
from videosft.stage_logs import stage_message


def stage(module: str, *args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "VIDEOSFT_DEBUG": "1" if debug else "0"}
    command = [sys.executable, "-m", f"videosft.stages.{module}", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=PROJECT, timeout=300)
    remember_output(command, result.stdout + result.stderr)
    return result


def assert_user_error(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and message in result.stderr


def test_a_bad_config_value(tmp_path):
    args = ["--config", json.dumps({"window": {"length": -1}}), "--out", str(tmp_path)]
    assert_user_error(stage("window", *args), "error: config key window.length: -1 is not allowed; it must be more "
                                              "than 0")
    debug = stage("window", *args, debug=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_too_many_rejects(demo_config, tmp_path):
    annotations = tmp_path / "annotations.jsonl"
    lines = Path(demo_config["data"]["annotations"]).read_text().splitlines()
    annotations.write_text("\n".join(lines + ["not json"]) + "\n")
    cfg = {**demo_config, "data": {**demo_config["data"], "annotations": str(annotations)}}
    result = stage("window", "--config", stage_json("window", cfg), "--out", str(tmp_path / "out"))
    assert_user_error(result, "error: 1 of 7 annotation lines rejected (limit data.max_reject_fraction=0.0)")


def test_a_checkpoint_that_does_not_fit(demo_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    model = shutil.copytree(demo_dir / "model", tmp_path / "model")
    save_file({"other.weight": torch.zeros(4)}, model / "model-other.safetensors")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["other.weight"] = "model-other.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    result = stage("probe", "--config", stage_json("probe", {"model": {"path": str(model)}}), "--out", str(tmp_path / "o"))
    assert_user_error(result, "does not fit the model:\n1 parameters unexpected in the checkpoint")


def test_a_stage_run_alone_on_a_missing_input_names_it(tmp_path):
    """As under Snakemake: a missing input is named, no traceback (an argument's, or a config path's)."""
    missing = stage("train", "--config", json.dumps({}), "--samples", str(tmp_path / "manifest.json"), "--probe",
                    str(tmp_path / "probe.json"), "--out", str(tmp_path / "train"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"argument --samples: {tmp_path / 'manifest.json'} does not exist" in missing.stderr
    config = {"data": {"annotations": str(tmp_path / "annotation.jsonl"), "root": str(tmp_path)}}
    assert_user_error(stage("window", "--config", json.dumps(config), "--out", str(tmp_path / "window")),
                      f"error: config data.annotations: {tmp_path / 'annotation.jsonl'} does not exist")


# A rank as the train stage ends one: a user's mistake through exit_after, or a bug's exception. The ranks
# meet before a mistake, as the stage's ranks reach its checks together: torchrun stops the other ranks once
# one has exited, and a rank still importing then would never say anything (seen once on a loaded machine).
RANK = """
import os, pathlib, sys, time
from videosft.errors import ConfigError
from videosft.provenance import exit_after

def meet():
    here = pathlib.Path(__file__).parent
    (here / ("ready" + os.environ["RANK"])).touch()
    deadline = time.monotonic() + 60
    while len(list(here.glob("ready*"))) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.01)

def main():
    if sys.argv[1] == "bug":
        raise RuntimeError("a bug, rank " + os.environ["RANK"])
    meet()
    error = ConfigError("train.steps: 0 is not allowed; set it to 1 or more")
    if os.environ["RANK"] == "1":
        error.kept_record = "logs/train/train.run_record.json"  # one rank keeps the record, as the stage's
    raise error

exit_after(main)
"""


@pytest.mark.slow  # torchrun imports torch: ~5 s
def test_what_torchrun_adds_after_a_failed_rank_never_hides_the_rank_s_own_message(tmp_path):
    """The terminal shows a failed stage's message from its log (Snakemake's onerror): under torchrun the
    log ends with the launcher's lines, its traceback and summary box, which say only that a rank failed."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    mistake = run_torchrun([str(script), "mistake"], nproc=2, timeout=120)
    assert mistake.returncode != 0 and "ChildFailedError" in mistake.stdout  # what the launcher adds is there
    assert stage_message(mistake.stdout).splitlines() == [
        "error: train.steps: 0 is not allowed; set it to 1 or more",
        "(the run record, with the traceback: logs/train/train.run_record.json)"]  # once, not once per rank
    bug = run_torchrun([str(script), "bug"], nproc=1, timeout=120)
    shown = stage_message(bug.stdout)
    assert bug.returncode != 0 and "ChildFailedError" in bug.stdout
    assert shown.splitlines()[-1] == "RuntimeError: a bug, rank 0" and "raise RuntimeError" in shown, shown
    assert "ChildFailedError" not in shown and "exitcode" not in shown

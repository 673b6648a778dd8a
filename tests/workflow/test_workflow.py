"""The Snakemake workflow as users run it: lint, the whole DAG, and what a rerun plans."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import copy_checkout, snakemake

PROJECT = Path(__file__).resolve().parents[2]
STAGES = {
    "demo": "data/demo",
    "window": "results/window",
    "preprocess": "results/preprocess",
    "probe": "results/probe",
    "train": "results/train",
    "verify": "results/verify",
    "report": "results/report",
}


def planned_jobs(output: str) -> dict[str, int]:
    """Rule -> count from the 'Job stats' table of a dry run."""
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A copy of the checkout, with nothing generated in it."""
    return copy_checkout(tmp_path_factory.mktemp("checkout"))


def test_lint_is_clean():
    result = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=PROJECT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lints for" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_no_test_calls_a_package_manager():
    """A test suite never changes the machine it runs on: system packages come from .ci/run or the
    user's explicit opt-in (bash .ci/install-slurm.sh), Python packages from the README's install."""
    managers = re.compile(r"""["'](apt-get|apt|dpkg|pip|pip3|conda|mamba|dnf|yum|npm)["']\s*,\s*["'](install|update|upgrade)""")
    for path in sorted((PROJECT / "tests").rglob("*.py")):
        if path.name != "test_workflow.py":
            assert not managers.search(path.read_text()), f"{path} calls a package manager"


@pytest.fixture(scope="module")
def full_run(workdir) -> Path:
    result = snakemake(workdir, "--cores", "2")
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((workdir / "logs").rglob("*.log")))
    assert result.returncode == 0, result.stderr[-4000:] + logs
    return workdir


def test_every_stage_writes_its_outputs_and_a_run_record(full_run):
    for stage, directory in STAGES.items():
        record = json.loads((full_run / directory / "run_record.json").read_text())
        assert record["stage"] == stage and record["status"] == "ok"
        assert Path(record["interpreter"]).exists()
        for package in ("torch", "transformers", "peft", "deepspeed", "snakemake", "decord", "pandas", "pyarrow"):
            assert record["packages"][package], f"{stage}: no version recorded for {package}"
        assert f"stages/{stage}.py" in record["sources"]
        for name, digest in record["sources"].items():
            path = full_run / "src" / "videosft" / name
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{stage}: hash of {name}"
        assert record["module_file"] == str(full_run / "src" / "videosft" / "stages" / f"{stage}.py")
        assert record["config_sha256"] and record["started"] <= record["ended"]
    assert (full_run / "results/window/windows.parquet").exists()
    manifest = json.loads((full_run / "results/preprocess/manifest.json").read_text())
    assert manifest["samples"] == {"train": 8, "val": 4}
    assert all((full_run / "results/preprocess" / name).exists() for names in manifest["files"].values() for name in names)
    for shard in (0, 1):
        record = json.loads((full_run / f"results/preprocess/shards/{shard}/run_record.json").read_text())
        assert record["status"] == "ok" and record["results"]["shard"] == shard
    probe = json.loads((full_run / "results/probe/probe.json").read_text())
    assert probe["ok"] and probe["mapped"] == probe["checkpoint_tensors"]
    verify = json.loads((full_run / "results/verify/verify.json").read_text())
    assert verify["ok"] and verify["tensors"]["matched"] == verify["tensors"]["tensors"] > 0
    train = json.loads((full_run / "results/train/run_record.json").read_text())["results"]
    assert train["world_size"] == 2 and train["load"]["matched"] == train["load"]["entries"]
    for rule in ("demo", "window", "preprocess", "probe", "train", "verify", "report"):
        assert (full_run / "logs" / rule / f"{rule}.log").exists()


def test_snakemake_report_embeds_every_figure(full_run):
    from videosft.stages.report import FIGURES

    record = json.loads((full_run / "results/report/run_record.json").read_text())
    assert record["status"] == "ok" and record["results"]["placeholders"] == [], record["results"]
    result = snakemake(full_run, "--report", "report.html")
    assert result.returncode == 0, result.stderr[-4000:]
    page = (full_run / "report.html").read_text()
    for name in [*(f"{figure}.png" for figure in FIGURES), "evaluation.html"]:
        assert name in page, f"{name} is not in report.html"


def test_nothing_to_do_after_a_full_run(full_run):
    result = snakemake(full_run, "-n")
    assert result.returncode == 0
    assert planned_jobs(result.stdout + result.stderr) == {}


def test_changing_one_stage_plans_it_and_what_follows(full_run):
    train_py = full_run / "src" / "videosft" / "stages" / "train.py"
    original = train_py.read_text()
    train_py.write_text(original + "\n# a change\n")
    try:
        result = snakemake(full_run, "-n")
        assert planned_jobs(result.stdout) == {"train": 1, "verify": 1, "report": 1, "all": 1}
    finally:
        train_py.write_text(original)

    config = full_run / "config.yaml"
    original = config.read_text()
    config.write_text(original.replace("steps: 4", "steps: 3"))
    try:
        result = snakemake(full_run, "-n", "--rerun-triggers", "params")
        assert planned_jobs(result.stdout) == {"train": 1, "verify": 1, "report": 1, "all": 1}
    finally:
        config.write_text(original)


def test_a_failed_stage_reruns_alone_once_fixed(full_run):
    zero3 = full_run / "workflow" / "deepspeed" / "zero3.json"
    good = zero3.read_text()
    zero3.write_text(good.replace('"stage": 3', '"stage": 2'))
    try:
        result = snakemake(full_run, "--cores", "2")
        assert result.returncode != 0 and "Error in rule train" in result.stdout + result.stderr
        assert "zero_optimization.stage must be 3" in (full_run / "logs/train/train.log").read_text()
        assert not (full_run / "results/train/adapter").exists(), "a failed stage left its output behind"
    finally:
        zero3.write_text(good)
    # the DeepSpeed config is read by the probe (memory plan) and the train stage: both rerun
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {"probe": 1, "train": 1, "verify": 1, "report": 1,
                                                              "all": 1}
    result = snakemake(full_run, "--cores", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    ran = re.findall(r"^(?:local)?rule (\w+):", result.stdout + result.stderr, re.M)
    assert sorted(set(ran)) == ["all", "probe", "report", "train", "verify"]


def test_forcerun_and_until_plan_what_the_readme_says(full_run):
    assert planned_jobs(snakemake(full_run, "-n", "--forcerun", "probe").stdout) == \
        {"probe": 1, "train": 1, "verify": 1, "report": 1, "all": 1}
    assert planned_jobs(snakemake(full_run, "-n", "--forcerun", "window", "--until", "probe").stdout) == \
        {"window": 1, "preprocess_shard": 2, "preprocess": 1, "probe": 1}


def test_predict_writes_cut_lists_for_every_demo_video(full_run):
    """`snakemake predict` (not part of the default target): ranges and editor timelines for every
    video of a folder."""
    import opentimelineio as otio

    assert planned_jobs(snakemake(full_run, "-n").stdout) == {}  # the default target does not predict
    folder = snakemake(full_run, "--cores", "2", "predict", "--config", "predict={'videos': 'data/demo/videos'}")
    assert folder.returncode == 0
    summary = json.loads((full_run / "results/predict/summary.json").read_text())
    videos = sorted(path.name for path in (full_run / "data/demo/videos").glob("*.mp4"))
    assert sorted(summary["outputs"]) == videos and summary["predicted"] == len(videos)
    for files in summary["outputs"].values():
        keep = json.loads((full_run / files["otio"]).parent.joinpath("keep.json").read_text())
        assert len(keep["windows"]) == 2 and isinstance(keep["ranges"], list)  # 16 s videos, 8 s windows
        edl = otio.adapters.read_from_file(str(full_run / files["edl"]), adapter_name="cmx_3600")
        assert len(edl.find_clips()) == len(keep["ranges"])
    # the default, predict.videos: val, with its source-time evaluation: tests/stages/test_predict.py

    # report.source_time puts predict's evaluation in the report: new videos have none, and it says so
    (full_run / "shown.yaml").write_text("report: {source_time: true}\n")
    shown = ["--configfile", "shown.yaml", "--config", "predict={'videos': 'data/demo/videos'}"]
    assert planned_jobs(snakemake(full_run, "-n", *shown).stdout) == {"report": 1, "all": 1}
    assert snakemake(full_run, "--cores", "2", *shown).returncode == 0
    page = (full_run / "results/report/evaluation.html").read_text()
    assert f"nothing to score: predict cut {len(videos)} of {len(videos)} new videos" in page
    # for the val split the default run predicts first (without the switch it does not: the first line above)
    assert planned_jobs(snakemake(full_run, "-n", "--configfile", "shown.yaml").stdout) == \
        {"predict": 1, "report": 1, "all": 1}


def test_an_interrupted_stage_is_found_and_rerun_with_rerun_incomplete(full_run):
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(full_run / "src")}
    log = full_run / "logs" / "train" / "train.log"
    log.unlink()  # the earlier run's log would look like this one's
    process = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--forcerun", "train"],
                               cwd=full_run, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "step 0" in log.read_text()):
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    subprocess.run(["pkill", "-9", "-f", f"--out {full_run}/results/train|videosft.stages.train"], check=False)
    result = snakemake(full_run, "-n")
    assert "incomplete" in (result.stdout + result.stderr).lower()
    assert planned_jobs(snakemake(full_run, "-n", "--rerun-incomplete").stdout) == {"train": 1, "verify": 1, "report": 1, "all": 1}
    locked = snakemake(full_run, "--cores", "2", "--rerun-incomplete")
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr  # a killed run leaves its lock
    assert snakemake(full_run, "--unlock").returncode == 0
    assert snakemake(full_run, "--cores", "2", "--rerun-incomplete").returncode == 0
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {}


def test_keep_going_finishes_the_independent_jobs_when_one_is_killed(full_run):
    """One preprocess shard dies (as under the OOM killer); --keep-going still finishes the other."""
    import time

    env = {**os.environ, "PYTHONPATH": str(full_run / "src")}
    manifest = full_run / "results/preprocess/manifest.json"
    gathered = manifest.stat().st_mtime_ns
    process = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "--keep-going",
                                "--forcerun", "preprocess_shard", "--until", "preprocess"],
                               cwd=full_run, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pattern = "videosft.stages.preprocess .*--shard 0 .*--out results/preprocess/shards/0"
    deadline = time.time() + 120
    killed = False
    while time.time() < deadline and process.poll() is None and not killed:
        killed = subprocess.run(["pkill", "-9", "-f", pattern], check=False).returncode == 0
        time.sleep(0.05)
    output, _ = process.communicate(timeout=300)
    assert killed, "shard 0 never started\n" + output[-3000:]
    assert process.returncode != 0 and "Error in rule preprocess_shard" in output, output[-3000:]
    shard_1 = json.loads((full_run / "results/preprocess/shards/1/run_record.json").read_text())
    assert shard_1["status"] == "ok" and shard_1["results"]["shard"] == 1
    assert not (full_run / "results/preprocess/shards/0").exists(), "the killed shard left its output behind"
    assert manifest.stat().st_mtime_ns == gathered, "the gather ran without one of its shards"
    # what is left is the killed shard and everything after it, not the shard that finished
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {
        "preprocess_shard": 1, "preprocess": 1, "probe": 1, "train": 1, "verify": 1, "report": 1, "all": 1}


@pytest.fixture(scope="module")
def user_run(full_run, tmp_path_factory) -> Path:
    """The pipeline on data outside the demo's folder, as a user's: annotations, videos and a checkpoint
    that Snakemake did not make, so it watches them only through the config's paths."""
    workdir = copy_checkout(tmp_path_factory.mktemp("user"))
    shutil.copytree(full_run / "data" / "demo", workdir / "mine", ignore=shutil.ignore_patterns(".*", "run_record.json"))
    (workdir / "mine.yaml").write_text(yaml.safe_dump({
        "data": {"annotations": "mine/annotations.jsonl", "root": "mine/videos"}, "model": {"path": "mine/model"}}))
    result = snakemake(workdir, "--cores", "2", "--configfile", "mine.yaml")
    assert result.returncode == 0
    assert not (workdir / "data" / "demo").exists()
    return workdir


def replace_keeping_mtime(path: Path, content: bytes) -> None:
    """New content under the old modification time: only the size tells the file changed."""
    stat = path.stat()
    path.write_bytes(content)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size != stat.st_size


def test_a_changed_video_or_checkpoint_file_reruns_its_stages(user_run):
    after_window = {"window": 1, "preprocess_shard": 2, "preprocess": 1, "probe": 1, "train": 1, "verify": 1,
                    "report": 1, "all": 1}
    assert planned_jobs(snakemake(user_run, "-n", "--configfile", "mine.yaml").stdout) == {}
    videos = sorted((user_run / "mine" / "videos").iterdir())
    original = videos[0].read_bytes()
    replace_keeping_mtime(videos[0], videos[1].read_bytes())
    try:
        assert planned_jobs(snakemake(user_run, "-n", "--configfile", "mine.yaml").stdout) == after_window
    finally:
        replace_keeping_mtime(videos[0], original)
    config = user_run / "mine" / "model" / "config.json"
    original = config.read_bytes()
    replace_keeping_mtime(config, original + b"\n")
    try:
        planned = planned_jobs(snakemake(user_run, "-n", "--configfile", "mine.yaml").stdout)
        assert planned == {key: count for key, count in after_window.items() if key != "window"}
    finally:
        replace_keeping_mtime(config, original)
    assert planned_jobs(snakemake(user_run, "-n", "--configfile", "mine.yaml").stdout) == {}


def test_a_missing_input_fails_before_anything_runs(user_run):
    windows = user_run / "results" / "window" / "windows.parquet"
    before = windows.stat().st_mtime_ns
    for key, value in (("annotations", "mine/nothing-here.jsonl"), ("root", "mine/no-videos")):
        (user_run / "gone.yaml").write_text(yaml.safe_dump({"data": {key: value}}))
        result = snakemake(user_run, "--cores", "2", "--configfile", "mine.yaml", "gone.yaml")
        output = result.stdout + result.stderr
        assert result.returncode != 0
        assert f"config data.{key}: {value} does not exist" in output and "Traceback" not in output, output[-2000:]
    (user_run / "gone.yaml").write_text(yaml.safe_dump({"model": {"path": "mine/no-model"}}))
    result = snakemake(user_run, "--cores", "2", "--configfile", "mine.yaml", "gone.yaml")
    assert result.returncode != 0 and "config model.path: mine/no-model does not exist" in result.stdout + result.stderr
    assert windows.stat().st_mtime_ns == before and not re.search(r"^rule \w+:", result.stdout, re.M)

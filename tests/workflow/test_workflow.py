"""The Snakemake workflow as users run it: lint, the whole DAG, and what a rerun plans."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import copy_checkout, planned_jobs, snakemake
from processes import gone, kill_tree

pytestmark = pytest.mark.slow  # the whole pipeline, and reruns of it

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


def wait_for_descendants(process: subprocess.Popen, timeout: float) -> None:
    """Until every process below ``process`` has ended (those they start as they go included)."""
    below = {child.pid: child for child in psutil.Process(process.pid).children(recursive=True)}
    deadline = time.monotonic() + timeout
    while not all(gone(child) for child in below.values()):
        assert time.monotonic() < deadline, f"still running after {timeout} s: {list(below.values())}"
        for child in list(below.values()):
            try:
                below.update((grandchild.pid, grandchild) for grandchild in child.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)


def ranks_below(process: subprocess.Popen) -> list[psutil.Process]:
    """The ranks among the processes below ``process``: torchrun gives them a run id of its own."""
    ranks = []
    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return ranks
    for child in below:
        try:
            if child.environ().get("TORCHELASTIC_RUN_ID") not in (None, os.environ.get("TORCHELASTIC_RUN_ID")):
                ranks.append(child)
        except psutil.Error:  # ended, or a zombie
            pass
    return ranks


def shard_0_of(snakemake_process: subprocess.Popen) -> psutil.Process | None:
    """The preprocess stage of shard 0 among the processes below ``snakemake_process``, once started."""
    try:
        below = psutil.Process(snakemake_process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for process in below:
        try:
            argv = process.cmdline()
        except psutil.Error:  # ended, or a zombie
            continue
        options = dict(zip(argv, argv[1:]))
        if options.get("-m") == "videosft.stages.preprocess" and options.get("--shard") == "0" \
                and options.get("--out") == "results/preprocess/shards/0":
            return process
    return None


# The command-line patterns (extended regular expressions over the whole command line) that these
# tests once killed every matching process of the machine by; {run} is full_run. Each also matches
# a job of another pipeline: its train stage, or its shard 0 (the same relative --out). The
# bystanders below are such processes.
OLD_PATTERNS = ["--out {run}/results/train|videosft.stages.train",
                "videosft.stages.preprocess .*--shard 0 .*--out results/preprocess/shards/0"]
BYSTANDER_ARGS = [["-m", "videosft.stages.train", "--out", "{elsewhere}/results/train"],
                  ["-m", "videosft.stages.preprocess", "--shard", "0", "--shards", "2", "--out",
                   "results/preprocess/shards/0"]]
# A bystander writes down every signal it receives (SIGKILL and SIGSTOP, which it cannot catch, would
# show as its end or its stop); it ends by itself once pytest, its parent, has gone.
SLEEPER = """\
import os, signal, sys, time
parent, record = os.getppid(), sys.argv[1]
def note(number, frame):
    with open(record, "a") as handle:
        handle.write(f"{number}\\n")
for number in set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP}:
    signal.signal(number, note)
open(record + ".ready", "w").close()
deadline = time.monotonic() + 3600
while os.getppid() == parent and time.monotonic() < deadline:
    time.sleep(0.5)
"""


@pytest.fixture(scope="module")
def bystanders(tmp_path_factory):
    """Two sleeping processes that look like another checkout's pipeline jobs, running while the tests
    that kill jobs do; each with the file its signals are written to."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    started = []
    try:
        for index, args in enumerate(BYSTANDER_ARGS):
            record = elsewhere / f"signals-{index}.txt"
            argv = [sys.executable, "-c", SLEEPER, str(record), *(a.format(elsewhere=elsewhere) for a in args)]
            started.append((subprocess.Popen(argv, cwd=elsewhere, start_new_session=True), record))
        deadline = time.monotonic() + 60
        while not all(record.with_name(record.name + ".ready").exists() for _, record in started):
            assert time.monotonic() < deadline, "the bystanders did not start"
            time.sleep(0.1)
        yield started
    finally:
        for process, _ in started:
            process.kill()
            process.wait()


def assert_untouched(bystanders) -> None:
    for process, record in bystanders:
        assert process.poll() is None, f"a process no test started was killed: {process.args[4:]}"
        assert psutil.Process(process.pid).status() != psutil.STATUS_STOPPED, process.args[4:]
        assert not record.exists() or record.read_text() == "", f"signalled: {record.read_text()}"


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


TERMINAL: dict[Path, str] = {}  # what the user read of a full run, by its folder


@pytest.fixture(scope="module")
def full_run(workdir) -> Path:
    result = snakemake(workdir, "--cores", "2")
    logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((workdir / "logs").rglob("*.log")))
    assert result.returncode == 0, result.stderr[-4000:] + logs
    TERMINAL[workdir] = result.stdout + result.stderr
    return workdir


def test_the_terminal_shows_each_job_in_a_line_then_what_each_stage_said(full_run):
    """Each job as one line (what it does and where its log is, not the dozens of source files it
    depends on), and after Snakemake's lines what each stage wrote into its log for the user: its
    warnings, each once, and what it made."""
    terminal = TERMINAL[full_run].splitlines()
    assert not [line for line in terminal if "src/videosft/" in line]
    assert "Job 2: train: the LoRA fine-tune, 2 rank(s) per node on 1 node(s) (log: logs/train/train.log)" in \
        [line.strip() for line in terminal]
    start = terminal.index("=== what the stages said (their whole logs are under logs/):")
    said = terminal[start + 1:next(i for i, line in enumerate(terminal) if line.startswith("Complete log"))]
    warnings = [line for line in said if line.startswith("WARNING: ")]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: LoRA targets ['q_proj', 'v_proj'] miss whole "
                                                         "layer types ['linear_attention']")  # the probe's
    own = [line for line in said if line not in warnings]
    assert [line.split(":")[0] for line in own] == ["demo", "window", "preprocess", "probe", "train", "verify", "report"]
    assert own[2].startswith("preprocess: 12 samples ({'train': 8, 'val': 4}) from 12 windows in 2 shards")
    assert own[4].startswith("train: 4/4 steps (100%)")
    assert own[5].startswith("verify: passed; on 4 val windows, fine-tuned mIoU ")
    assert own[6] == "report: 6 figures in results/report"


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
    from videosft.reporting import FIGURES

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
    """verify fails on an adapter cut short, says which file on the terminal, and once the file is whole
    again reruns with what follows it, nothing before; a changed DeepSpeed config plans the two stages
    that read it and what follows them (its checks: tests/training/test_setup.py)."""
    weights = full_run / "results" / "train" / "adapter" / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a copy stopped half way
    try:  # a file changed inside a directory output reruns nothing by itself: the user reruns verify
        result = snakemake(full_run, "--cores", "2", "--forcerun", "verify")
        shown = result.stdout + result.stderr
        assert result.returncode != 0 and "Error in rule verify" in shown
        assert "adapter_model.safetensors: not a readable safetensors file" in shown
        assert "Traceback" not in (full_run / "logs/verify/verify.log").read_text()
        assert not (full_run / "results/verify/verify.json").exists(), "a failed stage left its output behind"
    finally:
        weights.write_bytes(whole)
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {"verify": 1, "report": 1, "all": 1}
    result = snakemake(full_run, "--cores", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    ran = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", result.stdout + result.stderr)
    assert sorted(set(ran)) == ["all", "report", "verify"]

    zero3 = full_run / "workflow" / "deepspeed" / "zero3.json"
    good = zero3.read_text()
    zero3.write_text(good.replace('"stage": 3', '"stage": 2'))
    try:  # the DeepSpeed config is read by the probe (memory plan) and the train stage: both would rerun
        assert planned_jobs(snakemake(full_run, "-n").stdout) == {"probe": 1, "train": 1, "verify": 1, "report": 1,
                                                                  "all": 1}
    finally:
        zero3.write_text(good)
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {}


def test_forcerun_and_until_plan_what_the_readme_says(full_run):
    assert planned_jobs(snakemake(full_run, "-n", "--forcerun", "probe").stdout) == \
        {"probe": 1, "train": 1, "verify": 1, "report": 1, "all": 1}
    assert planned_jobs(snakemake(full_run, "-n", "--forcerun", "window", "--until", "probe").stdout) == \
        {"window": 1, "preprocess_shard": 2, "preprocess": 1, "probe": 1}


def test_predict_writes_cut_lists_for_every_demo_video(full_run):
    """`snakemake predict` (not part of the default target): ranges and editor timelines for every
    video of a folder of new videos (two of the demo's, copied)."""
    import opentimelineio as otio

    assert planned_jobs(snakemake(full_run, "-n").stdout) == {}  # the default target does not predict
    new = full_run / "new_videos"
    new.mkdir()
    for video in sorted((full_run / "data/demo/videos").glob("*.mp4"))[:2]:
        shutil.copy(video, new / video.name)
    folder = snakemake(full_run, "--cores", "2", "predict", "--config", "predict={'videos': 'new_videos'}")
    assert folder.returncode == 0
    summary = json.loads((full_run / "results/predict/summary.json").read_text())
    videos = sorted(path.name for path in new.glob("*.mp4"))
    assert sorted(summary["outputs"]) == videos and summary["predicted"] == len(videos)
    for files in summary["outputs"].values():
        keep = json.loads((full_run / files["otio"]).parent.joinpath("keep.json").read_text())
        assert len(keep["windows"]) == 2 and isinstance(keep["ranges"], list)  # 16 s videos, 8 s windows
        edl = otio.adapters.read_from_file(str(full_run / files["edl"]), adapter_name="cmx_3600")
        assert len(edl.find_clips()) == len(keep["ranges"])
    # the default, predict.videos: val, with its source-time evaluation: tests/stages/test_predict.py

    # report.source_time puts predict's evaluation in the report: new videos have none, and it says so
    (full_run / "shown.yaml").write_text("report: {source_time: true}\n")
    shown = ["--configfile", "shown.yaml", "--config", "predict={'videos': 'new_videos'}"]
    assert planned_jobs(snakemake(full_run, "-n", *shown).stdout) == {"report": 1, "all": 1}
    assert snakemake(full_run, "--cores", "2", *shown).returncode == 0
    page = (full_run / "results/report/evaluation.html").read_text()
    assert f"nothing to score: predict cut {len(videos)} of {len(videos)} new videos" in page
    # for the val split the default run predicts first (without the switch it does not: the first line above)
    assert planned_jobs(snakemake(full_run, "-n", "--configfile", "shown.yaml").stdout) == \
        {"predict": 1, "report": 1, "all": 1}


def test_an_interrupted_stage_is_found_and_rerun_with_rerun_incomplete(full_run, bystanders):
    """Snakemake killed while its train job runs on to the end (as when the session that runs it dies):
    the outputs are there, but Snakemake never recorded them complete. (A job killed with it leaves
    no outputs to flag: Snakemake then plans the stage for its missing outputs.)"""
    env = {**os.environ, "PYTHONPATH": str(full_run / "src")}
    log = full_run / "logs" / "train" / "train.log"
    log.unlink()  # the earlier run's log would look like this one's
    process = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--forcerun", "train"],
                               cwd=full_run, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        # Snakemake stopped once torchrun has started the ranks (long after it marked train's outputs
        # incomplete, long before they can be complete), so that it records nothing more; its job (the
        # shell, torchrun and the ranks, in sessions of their own) trains to the end and is waited for.
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None and len(ranks_below(process)) < 2:
            time.sleep(0.1)
        assert len(ranks_below(process)) == 2, "torchrun never started the ranks"
        psutil.Process(process.pid).suspend()
        wait_for_descendants(process, timeout=300)
    finally:
        kill_tree(process)  # Snakemake, and anything of its job still running after a failure above
    assert "step 0" in log.read_text(), "the train job never trained"
    assert_untouched(bystanders)
    result = snakemake(full_run, "-n")
    assert "incomplete" in (result.stdout + result.stderr).lower()
    assert planned_jobs(snakemake(full_run, "-n", "--rerun-incomplete").stdout) == {"train": 1, "verify": 1, "report": 1, "all": 1}
    locked = snakemake(full_run, "--cores", "2", "--rerun-incomplete")
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr  # a killed run leaves its lock
    assert snakemake(full_run, "--unlock").returncode == 0
    assert snakemake(full_run, "--cores", "2", "--rerun-incomplete").returncode == 0
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {}


def test_keep_going_finishes_the_independent_jobs_when_one_is_killed(full_run, bystanders):
    """One preprocess shard dies (as under the OOM killer); --keep-going still finishes the other."""
    env = {**os.environ, "PYTHONPATH": str(full_run / "src")}
    manifest = full_run / "results/preprocess/manifest.json"
    gathered = manifest.stat().st_mtime_ns
    process = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "--keep-going",
                                "--forcerun", "preprocess_shard", "--until", "preprocess"],
                               cwd=full_run, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.time() + 120
        killed = False
        while time.time() < deadline and process.poll() is None and not killed:
            shard = shard_0_of(process)  # this Snakemake's own job, not another pipeline's shard 0
            if shard is not None:
                kill_tree(shard)
                killed = True
            time.sleep(0.05)
        output, _ = process.communicate(timeout=300)
    finally:
        kill_tree(process)
    assert_untouched(bystanders)
    assert killed, "shard 0 never started\n" + output[-3000:]
    assert process.returncode != 0 and "Error in rule preprocess_shard" in output, output[-3000:]
    shard_1 = json.loads((full_run / "results/preprocess/shards/1/run_record.json").read_text())
    assert shard_1["status"] == "ok" and shard_1["results"]["shard"] == 1
    assert not (full_run / "results/preprocess/shards/0").exists(), "the killed shard left its output behind"
    assert manifest.stat().st_mtime_ns == gathered, "the gather ran without one of its shards"
    # what is left is the killed shard and everything after it, not the shard that finished
    assert planned_jobs(snakemake(full_run, "-n").stdout) == {
        "preprocess_shard": 1, "preprocess": 1, "probe": 1, "train": 1, "verify": 1, "report": 1, "all": 1}


def test_the_killing_tests_spared_processes_they_did_not_start(full_run, bystanders):
    """The bystanders lived through the tests above that kill jobs (run beside them, in this module),
    although the pattern those tests once killed by matches each; then the test that started them
    stops them."""
    for (process, _), pattern in zip(bystanders, OLD_PATTERNS):
        command_line = " ".join(psutil.Process(process.pid).cmdline())
        assert re.search(pattern.format(run=full_run), command_line), (pattern, command_line)
    assert_untouched(bystanders)
    for process, _ in bystanders:
        kill_tree(process)
        assert process.returncode == -9

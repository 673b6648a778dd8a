"""The workflow on a user's data: what a changed input reruns, and a missing one stopping everything.
Its own module, apart from test_workflow.py's runs on the demo (pytest-xdist gives each file to one
worker, so the two pipelines can run at once)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import copy_checkout, planned_jobs, snakemake

pytestmark = pytest.mark.slow  # the whole pipeline


UNTIL_PROBE = ("--configfile", "mine.yaml", "--until", "probe")


@pytest.fixture(scope="module")
def user_run(demo_dir, tmp_path_factory) -> Path:
    """The pipeline on data outside the demo's folder, as a user's: annotations, videos and a checkpoint
    that Snakemake did not make, so it watches them only through the config's paths. (The demo's,
    as the session made them: the demo rule's own outputs, without a run of the whole pipeline first.)
    Up to the probe: what a changed input reruns is decided there; the stages after it follow their
    inputs (tests/workflow/test_workflow.py)."""
    workdir = copy_checkout(tmp_path_factory.mktemp("user"))
    shutil.copytree(demo_dir, workdir / "mine", ignore=shutil.ignore_patterns(".*", "run_record.json"))
    (workdir / "mine.yaml").write_text(yaml.safe_dump({
        "data": {"annotations": "mine/annotations.jsonl", "root": "mine/videos"}, "model": {"path": "mine/model"}}))
    result = snakemake(workdir, "--cores", "2", *UNTIL_PROBE)
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
    after_window = {"window": 1, "preprocess_shard": 2, "preprocess": 1, "probe": 1}
    assert planned_jobs(snakemake(user_run, "-n", *UNTIL_PROBE).stdout) == {}
    videos = sorted((user_run / "mine" / "videos").iterdir())
    original = videos[0].read_bytes()
    replace_keeping_mtime(videos[0], videos[1].read_bytes())
    try:
        assert planned_jobs(snakemake(user_run, "-n", *UNTIL_PROBE).stdout) == after_window
    finally:
        replace_keeping_mtime(videos[0], original)
    config = user_run / "mine" / "model" / "config.json"
    original = config.read_bytes()
    replace_keeping_mtime(config, original + b"\n")
    try:
        planned = planned_jobs(snakemake(user_run, "-n", *UNTIL_PROBE).stdout)
        assert planned == {key: count for key, count in after_window.items() if key != "window"}
    finally:
        replace_keeping_mtime(config, original)
    assert planned_jobs(snakemake(user_run, "-n", *UNTIL_PROBE).stdout) == {}


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
    # no job started: none announced, by its rule's message or (--verbose) its details
    assert windows.stat().st_mtime_ns == before and not re.search(r"^(?:(?:local)?rule \w+:|Job \d+: )",
                                                                  result.stdout, re.M)

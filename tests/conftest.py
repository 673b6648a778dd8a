"""Shared fixtures: the embedded demo (videos + tiny Qwen3.5 checkpoint), made once per session."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# One thread per process, before torch is imported here or in any process a test starts (they inherit
# it). The suite runs two workers on two cores, each starting stages and ranks of its own: torch's
# default of a thread per core then has OpenMP threads spinning against each other, which made a
# verify stage of 6 s take over 300 s in a full run.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from processes import run_bounded
from videosft import config as config_lib

PROJECT = Path(__file__).resolve().parents[1]
# Each model family's tiny checkpoint is built by tests/models/tiny_checkpoints.py, beside the registry's tests.
sys.path.append(str(Path(__file__).resolve().parent / "models"))
# What a failing test shows of the processes it ran: the last characters of each one's output.
OUTPUT_TAIL = 6000
# How a collective that waited past its process-group timeout reads in a rank's output (gloo, c10d, DeepSpeed).
PROCESS_GROUP_TIMEOUT = re.compile(r"timed out|timeout|Timed out|DistBackendError|Connection reset by peer")
_subprocess_outputs: list[tuple[str, str]] = []


def remember_output(command, output: str | None) -> None:
    """Keep a subprocess's output so that a failing test shows it (see pytest_runtest_makereport)."""
    text = " ".join(map(str, command)) if isinstance(command, (list, tuple)) else str(command)
    _subprocess_outputs.append((text, output or ""))


@pytest.fixture(autouse=True)
def _forget_outputs():
    _subprocess_outputs.clear()
    yield


# The files that take longest (a fresh clone's --durations=0 on 2 cores, 2026-12-03: learning 531 s,
# workflow 222, Slurm 210, train policies 161, families 144, then 53 s down to 11), longest first. The
# two workers take whole files in collection order (--no-loadscope-reorder), so the short files fill
# the end instead of longer ones running alone (before, two 34 s files ended the run with a core idle
# up to half the time over its last three minutes). The Slurm file waits on its executor's polling
# most of its time and the learning file starts with the demo's pretraining, one process: side by
# side they can leave a core idle, so the Slurm file comes third, when the learning file trains on
# two ranks (vmstat: under 2% idle from the first minute on; from the sixth before).
LONGEST_FIRST = ["workflow/test_learning.py", "stages/test_train_policies.py", "workflow/test_slurm.py",
                 "workflow/test_workflow.py", "models/test_families.py",
                 "stages/test_sequence_parallel_training.py", "stages/test_train_verify.py",
                 "stages/test_packed_training.py", "stages/test_whole_blocks.py", "workflow/test_user_data.py",
                 "workflow/test_user_errors.py", "stages/test_train_data_scale.py", "stages/test_four_ranks.py",
                 "stages/test_real_videos.py", "training/test_sequence_parallel.py", "stages/test_report.py",
                 "stages/test_errors.py", "encoding/test_layout.py"]

# Slow cases of parametrized tests whose other cases are fast (a marker line on the test would take
# them all), by node id under tests/. The rest of the slow tests say so in their files.
SLOW_CASES = {
    # builds the published Qwen3.5 checkpoint with its real tokenizer (248k tokens): about 8 s
    "encoding/test_layout.py::test_preprocess_writes_the_layout_token_for_token[published_qwen3_5-blocks]",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    def relative(item) -> str:
        return item.path.relative_to(Path(__file__).parent).as_posix()

    def rank(item) -> int:
        return LONGEST_FIRST.index(relative(item)) if relative(item) in LONGEST_FIRST else len(LONGEST_FIRST)

    moved = [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).is_file()]
    if moved:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {moved}")
    for item in items:
        if f"{relative(item)}::{item.name}" in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=rank)  # stable: collection order within a file and among the others


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the output of every process it ran, and says so by name
    when a process group timed out, or a process outlived the test's own timeout."""
    report = (yield).get_result()
    if report.when == "teardown" or not report.failed:  # setup covers the fixtures that run processes
        return
    outputs = list(_subprocess_outputs)
    if call.excinfo is not None and isinstance(call.excinfo.value, subprocess.TimeoutExpired):
        expired = call.excinfo.value
        partial = expired.output.decode(errors="replace") if isinstance(expired.output, bytes) else expired.output
        outputs.append((f"{expired.cmd} (killed after the test's timeout of {expired.timeout} s)", partial or ""))
    for command, output in outputs:
        heading = f"output of {command[:300]}"
        if PROCESS_GROUP_TIMEOUT.search(output):
            heading = "PROCESS GROUP TIMEOUT (a rank waited past its timeout: a loaded machine, or a rank that " \
                      f"died or hung) in {heading}"
        report.sections.append((heading, output[-OUTPUT_TAIL:]))


def assert_ranges_close(actual, expected, tolerance: float = 1e-9) -> None:
    """Two lists of (start, end) ranges: the same count, each bound within ``tolerance``."""
    actual, expected = [tuple(r) for r in actual], [tuple(r) for r in expected]
    assert len(actual) == len(expected) and all(
        abs(a - b) <= tolerance for pair, other in zip(actual, expected) for a, b in zip(pair, other)), (actual, expected)


def stage_json(stage: str, overrides: dict | None = None) -> str:
    """A stage's --config as Snakemake passes it: the sections it reads, defaults filled."""
    return json.dumps(config_lib.stage_config(stage, config_lib.resolve(overrides or {})))


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    from videosft.stages import demo

    out = tmp_path_factory.mktemp("demo")
    assert demo.main(["--config", stage_json("demo"), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def demo_config(demo_dir) -> dict:
    """Config overrides that point the stages at the session's demo data."""
    return {
        "data": {"annotations": str(demo_dir / "annotations.jsonl"), "root": str(demo_dir / "videos")},
        "model": {"path": str(demo_dir / "model")},
        "train": {"deepspeed_config": str(PROJECT / "workflow" / "deepspeed" / "zero3.json")},
    }


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, demo_config) -> Path:
    """window + preprocess + probe outputs on the demo, under one results directory."""
    from videosft.stages import preprocess
    from videosft.stages import probe
    from videosft.stages import window

    results = tmp_path_factory.mktemp("results")
    assert window.main(["--config", stage_json("window", demo_config), "--out", str(results / "window")]) == 0
    shards = [results / "preprocess" / "shards" / str(i) for i in range(2)]
    for index, shard in enumerate(shards):
        assert preprocess.main(["--config", stage_json("preprocess", demo_config), "--shard", str(index),
                                "--shards", "2", "--windows", str(results / "window" / "windows.parquet"),
                                "--out", str(shard)]) == 0
    assert preprocess.main(["--config", stage_json("preprocess", demo_config), "--gather", *map(str, shards),
                            "--out", str(results / "preprocess")]) == 0
    assert probe.main(["--config", stage_json("probe", demo_config), "--samples",
                       str(results / "preprocess" / "manifest.json"), "--out", str(results / "probe")]) == 0
    return results


@pytest.fixture(scope="session")
def qwen25_dir(demo_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL checkpoint as transformers saves it: legacy model.layers.* / visual.* keys."""
    from tiny_checkpoints import transformers_qwen25

    return transformers_qwen25(tmp_path_factory.mktemp("qwen25"), demo_dir)


@pytest.fixture(scope="session")
def qwen3vl_dir(demo_dir, tmp_path_factory) -> Path:
    """A tiny Qwen3-VL checkpoint saved by transformers: model.language_model.* / model.visual.* keys."""
    from tiny_checkpoints import transformers_qwen3vl

    return transformers_qwen3vl(tmp_path_factory.mktemp("qwen3vl"), demo_dir)


@pytest.fixture(scope="session")
def published_qwen35(tmp_path_factory) -> Path:
    """A Qwen3.5 checkpoint laid out as published, with the real tokenizer (tests/published.py)."""
    from published import published_qwen35 as build

    return build(tmp_path_factory.mktemp("published-qwen35"))


@pytest.fixture(scope="session")
def published_qwen3vl(tmp_path_factory) -> Path:
    """A Qwen3-VL checkpoint laid out as published, with the real tokenizer (tests/published.py)."""
    from published import published_qwen3vl as build

    return build(tmp_path_factory.mktemp("published-qwen3vl"))


def saved_adapter(base, out: Path, rank: int, alpha: int, targets: list[str]) -> Path:
    """A LoRA adapter on ``base`` with non-zero B (an untrained one leaves the base unchanged), saved to
    ``out`` as peft saves it."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    model.save_pretrained(out)
    return out


def run_torchrun(args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None):
    """A real multi-process run, as the train rule starts it; a failing test shows its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = run_bounded(command, timeout=timeout, env=environment, cwd=PROJECT)
    remember_output(command, result.stdout)
    return result


CHECKOUT = ["Snakefile", "config.yaml", "workflow", "src", "data/README.md"]


def copy_checkout(root: Path) -> Path:
    """The tracked workflow files in ``root``, as a fresh clone has them (nothing generated)."""
    for name in CHECKOUT:
        source, target = PROJECT / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, target)
    return root


def snakemake(workdir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Snakemake in a copied checkout; the copy's own src/ comes first, as its editable install would.
    A failing test shows Snakemake's output and the log of every job that failed."""
    env = {**os.environ, "PYTHONPATH": str(workdir / "src")}
    command = [sys.executable, "-m", "snakemake", *args]
    result = run_bounded(command, timeout=timeout, env=env, merge_stderr=False, cwd=workdir)
    remember_output(command, result.stdout + result.stderr)
    for log in failed_job_logs(workdir, result.stdout + result.stderr):
        remember_output([f"log of a failed job, {log}"], log.read_text(errors="replace"))
    return result


def planned_jobs(output: str) -> dict[str, int]:
    """Rule -> count from the 'Job stats' table of a dry run."""
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


def failed_job_logs(workdir: Path, output: str) -> list[Path]:
    """The logs Snakemake names in its 'Error in rule' blocks."""
    logs = []
    for block in output.split("Error in rule ")[1:]:
        match = re.search(r"^\s*log: (\S+)", block, re.MULTILINE)
        if match and (workdir / match.group(1)).is_file():
            logs.append(workdir / match.group(1))
    return logs


def scale_gradient(tensor, factor: float):
    """``tensor`` unchanged; its gradient scaled by ``factor`` on the way back (a kernel with one wrong
    gradient, for checks that must catch it)."""
    import torch

    class ScaleGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * factor

    return ScaleGradient.apply(tensor)


def check_host_positions(model_dir: Path, rows: list[dict]) -> None:
    """The multimodal positions the host computes give the model exactly the loss its own, computed
    inside the forward, give; and the positions given do reach the model (moving the video one frame
    pair later changes its logits), so the comparison can fail. (Not its loss: a tiny random model's
    answer positions may depend on the video's below float32's resolution.)"""
    import torch
    from transformers import AutoConfig

    from videosft.training.batches import collate, host_positions, prepare
    from videosft.media.pixels import load_video_processor
    from videosft.models.checkpoint import model_class
    from videosft.training.loss import supervised_loss

    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.float32)
    video_processor = load_video_processor(model_dir)
    inside = collate(rows, pad_id=0, video_processor=video_processor)
    on_host = prepare(rows, 0, video_processor, host_positions(model), pin=False)
    assert on_host["position_ids"].shape[-2:] == inside["input_ids"].shape
    video = inside["mm_token_type_ids"] == 2
    shifted = {**on_host, "position_ids": on_host["position_ids"].clone()}
    shifted["position_ids"][0][video] += 1
    with torch.no_grad():
        expected, got = (supervised_loss(model, batch) for batch in (inside, on_host))
        given, moved = (model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
                        for batch in (on_host, shifted))
    assert torch.equal(got, expected), (got, expected)
    assert not torch.equal(moved, given)

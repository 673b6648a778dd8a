"""Autotuning choices saved and restored (videosft.kernels.autotune), on real Triton autotuners.

Nothing here runs a kernel (no GPU): restoring fills the choice cache that Triton's own
``Autotuner.run`` consults before benchmarking, which is what these tests look at.
"""

from __future__ import annotations

import json

import pytest
import triton
import triton.language as tl

from videosft.kernels import autotune
from videosft.errors import ConfigError

CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 32}, num_warps=4, num_stages=3)]


@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


NAME = f"{__name__}.scale_kernel"
KEY = (4096, "torch.bfloat16")


@pytest.fixture(autouse=True)
def empty_cache():
    scale_kernel.cache = {}
    yield
    scale_kernel.cache = {}


def test_finds_the_autotuners_of_a_module_tree_by_kernel_name():
    tuners = autotune.autotuners(prefix=__name__)
    assert tuners == {NAME: scale_kernel}


def test_restores_a_choice_as_the_kernels_own_candidate():
    table = {NAME: [[list(KEY), autotune.describe(CONFIGS[1])]]}
    summary = autotune.restore(table, autotune.autotuners(prefix=__name__))
    assert summary == {"restored": 1, "stale": [], "absent": [], "borrowed": {NAME: []}}
    assert scale_kernel.cache == {KEY: CONFIGS[1]}
    assert scale_kernel.cache[KEY] is CONFIGS[1]  # the object Triton would have picked, hooks and all


def test_a_choice_the_kernel_no_longer_offers_or_an_unknown_kernel_is_counted_not_restored():
    gone = autotune.describe(triton.Config({"BLOCK": 64}, num_warps=8))
    table = {NAME: [[list(KEY), gone]], "fla.ops.removed.kernel": [[[1], gone]]}
    summary = autotune.restore(table, autotune.autotuners(prefix=__name__))
    assert summary == {"restored": 0, "stale": [NAME], "absent": ["fla.ops.removed.kernel"], "borrowed": {}}
    assert scale_kernel.cache == {}  # those keys autotune as before


def test_choices_round_trip_through_json():
    scale_kernel.cache[KEY] = CONFIGS[0]
    scale_kernel.cache[(128, "torch.float32")] = CONFIGS[1]
    saved = json.loads(json.dumps(autotune.choices(autotune.autotuners(prefix=__name__))))
    scale_kernel.cache.clear()
    assert autotune.restore(saved, autotune.autotuners(prefix=__name__))["restored"] == 2
    assert scale_kernel.cache == {KEY: CONFIGS[0], (128, "torch.float32"): CONFIGS[1]}


def test_a_choice_already_made_in_this_process_is_kept():
    scale_kernel.cache[KEY] = CONFIGS[0]
    autotune.restore({NAME: [[list(KEY), autotune.describe(CONFIGS[1])]]}, autotune.autotuners(prefix=__name__))
    assert scale_kernel.cache[KEY] is CONFIGS[0]


def test_the_table_switch(tmp_path):
    assert autotune.table_path(None, "full") is None
    with pytest.raises(ConfigError, match=f"{autotune.ENV}=.*missing.json: no such file"):
        autotune.table_path(None, str(tmp_path / "missing.json"))
    table = tmp_path / "autotune.json"
    table.write_text("{}")
    assert autotune.table_path(None, str(table)) == table


def test_nothing_is_restored_off_a_gpu():
    import torch

    assert autotune.apply(torch.device("cpu")) == {"requested": "table", "table": None, "restored": 0}


STOPPED_RUN = """
import os, signal, sys
import triton
import triton.language as tl
from videosft.kernels import autotune

@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=2)], key=["n"])
@triton.jit
def kernel(x_ptr, n, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)))

autotune.save_when_stopped(sys.argv[1], "TEST_GPU", "a stopped run", prefix="__main__")
kernel.cache[(4096,)] = kernel.configs[0]  # what autotuning had chosen when the stop came
os.kill(os.getpid(), signal.SIGTERM)
raise SystemExit("still running after SIGTERM")
"""


def test_a_run_stopped_while_autotuning_keeps_the_choices_made_so_far(tmp_path):
    import signal
    import subprocess
    import sys

    table, script = tmp_path / "autotune.json", tmp_path / "stopped_run.py"  # Triton reads a kernel's source file
    script.write_text(STOPPED_RUN)
    ended = subprocess.run([sys.executable, str(script), str(table)], capture_output=True, text=True, timeout=120)
    assert ended.returncode == -signal.SIGTERM, ended.stderr  # it still stops, as SIGTERM's default does
    saved = json.loads(table.read_text())
    assert saved["gpu"] == "TEST_GPU" and saved["written_by"] == "a stopped run"
    assert saved["kernels"] == {"__main__.kernel": [[[4096], autotune.describe(triton.Config({"BLOCK": 16}, num_warps=2))]]}


def test_the_log_line_says_what_was_restored_and_what_was_not():
    assert autotune.summary({"requested": "full", "table": None, "restored": 0}) == \
        f"autotune: no table restored ({autotune.ENV}=full); fla's kernels autotune on first use"
    line = autotune.summary({"requested": "table", "table": "NVIDIA_H200.json", "restored": 40, "stale": ["fla.x.k"]})
    assert line.startswith("autotune: 40 choices restored from NVIDIA_H200.json") and "fla.x.k" in line


# fla's layer_norm keys as the H200 table holds them: (block, row blocks, flags..., dtypes)
NORM_KEYS = [(256, 64, False, True, "torch.bfloat16"), (256, 2, False, True, "torch.bfloat16")]


def test_the_nearest_key_differs_only_where_the_tables_keys_follow_the_length():
    assert autotune.nearest_key((256, 30, False, True, "torch.bfloat16"), NORM_KEYS) == NORM_KEYS[0]
    assert autotune.nearest_key((256, 3, False, True, "torch.bfloat16"), NORM_KEYS) == NORM_KEYS[1]
    # another block size, flag or dtype is another kernel variant: it autotunes
    assert autotune.nearest_key((128, 30, False, True, "torch.bfloat16"), NORM_KEYS) is None
    assert autotune.nearest_key((256, 30, True, True, "torch.bfloat16"), NORM_KEYS) is None
    assert autotune.nearest_key((256, 30, False, True, "torch.float32"), NORM_KEYS) is None
    # a kernel tuned at one key shows nothing that varies with the length
    assert autotune.nearest_key((256, 30, False, True, "torch.bfloat16"), NORM_KEYS[:1]) is None


def test_an_unknown_length_runs_the_nearest_keys_choice_without_benchmarking():
    import torch

    table = {NAME: [[[4096, "torch.float32"], autotune.describe(CONFIGS[1])],
                    [[128, "torch.float32"], autotune.describe(CONFIGS[0])]]}
    summary = autotune.restore(table, autotune.autotuners(prefix=__name__))
    scale_kernel.best_config = None
    # Triton's own Autotuner.run picks the config; only the launch needs the GPU this machine lacks
    with pytest.raises(RuntimeError):
        scale_kernel[(1,)](torch.zeros(1000), 1000)
    assert scale_kernel.best_config is CONFIGS[1]  # 1000 is nearer 4096 than 128 (log ratio)
    assert getattr(scale_kernel, "bench_time", None) is None  # nothing was benchmarked
    assert summary["borrowed"] == {NAME: ["[1000, 'torch.float32'] <- [4096, 'torch.float32']"]}
    # a saved table holds only what was tuned or restored, never a borrowed choice
    assert [key for key, _ in autotune.choices(autotune.autotuners(prefix=__name__))[NAME]] == \
        [[4096, "torch.float32"], [128, "torch.float32"]]

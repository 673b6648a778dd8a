"""A GPU run on a slow path nobody asked for says so, loudly, where the user looks first."""

from __future__ import annotations

import types

from videosft.kernels import gated_deltanet
from videosft.kernels.selection import slow_paths, summary

GPU, CPU = types.SimpleNamespace(type="cuda"), types.SimpleNamespace(type="cpu")
NO_FLA = {"importable": False, "error": "ModuleNotFoundError: No module named 'fla'"}


def kernels(reason: str) -> dict:
    return {"gated_deltanet": {"implementation": "torch", "reason": reason, "fla": NO_FLA},
            "fused": {"implementation": {"rms_norm": None}}, "autotune": {"requested": "table", "table": None}}


def test_a_gpu_run_without_fla_is_warned_with_the_cost_and_the_fix():
    (warning,) = slow_paths(kernels("fla does not import"), GPU)
    assert warning.startswith("WARNING: flash-linear-attention does not import here (ModuleNotFoundError")
    assert "30-60x slower per layer" in warning and gated_deltanet.INSTALL in warning
    assert f"{gated_deltanet.ENV}=torch" in warning
    record = {**kernels("fla does not import"), "warnings": [warning]}
    assert summary(record, GPU)[0] == warning  # the first line the train log shows


def test_the_torch_path_asked_for_or_on_a_cpu_is_not_warned_about():
    assert slow_paths(kernels("asked for"), GPU) == []  # VIDEOSFT_GATED_DELTANET=torch
    assert slow_paths(kernels("fla does not import"), CPU) == []  # the CPU has no fla path to miss


def test_the_vision_rotary_embedding_has_its_line():
    checked = {**kernels("asked for"), "vision_rotary": {"implementation": "triton", "checks": [{}] * 4}}
    assert ("vision rotary embedding: triton (one kernel, equal to transformers' bit for bit in 4 checks)") in summary(checked, CPU)
    kept = {**kernels("asked for"), "vision_rotary": {"implementation": "torch", "reason": "asked for", "checks": []}}
    assert "vision rotary embedding: torch (asked for)" in summary(kept, CPU)
    assert not any("vision rotary" in line for line in summary(kernels("asked for"), CPU))  # a model without a tower

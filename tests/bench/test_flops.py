"""What the benchmarks' utilization figures mean (bench/flops.py), and their same-math check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from flops import H200_BF16_PEAK, Shape, hardware_flops_per_token, model_flops_per_token, shape_of, utilization  # noqa: E402


def test_model_and_hardware_flops_by_hand():
    shape = Shape(n_text=1000, n_vision=100, full_attention_layers=2, d_attention=8, tokens=50, patches=40)
    model = 4 * 1000 + 12 * 2 * 50 * 8 + 2 * 100 * 40 / 50  # forward + input gradients, attention fwd + bwd, vision fwd
    assert model_flops_per_token(shape) == model
    assert hardware_flops_per_token(shape) == model + 2 * 1000 + 4 * 2 * 50 * 8  # + the recomputed forward
    assert hardware_flops_per_token(shape, recomputed=False) == model
    rates = utilization(1e9, shape)
    assert rates["mfu"] == pytest.approx(1e9 * model / 989e12) and rates["hfu"] > rates["mfu"]


def test_the_readmes_qwen35_4b_figure_by_both_definitions():
    """Call 11 (2x H200, 128 frames, 13,386 tokens per rank): 11,055 tokens/s per GPU was published as
    41% "MFU" (6N against the measured 787 TFLOP/s matmul rate); by the standard definition it is 24.6%."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**json.loads((BENCH / "configs" / "Qwen3.5-4B.json").read_text()))
    shape = shape_of(config, tokens=13_386, visual_tokens=12_544)
    assert shape.full_attention_layers == 8 and shape.d_attention == 16 * 256 and shape.patches == 50_176
    rates = utilization(11_055, shape, H200_BF16_PEAK)
    assert round(rates["mfu"], 3) == 0.246 and round(rates["hfu"], 3) == 0.346
    old = 6 * shape.n_text + 12 * 8 * 13_386 * 4096 + 2 * shape.n_vision * shape.patches / shape.tokens
    assert round(11_055 * old / 787e12, 2) == 0.41  # what was called MFU before


def test_trainers_that_did_not_compute_the_same_math_fail_the_benchmark():
    from train_throughput import LOSS_TOLERANCE, same_math

    def results(ours, plain, ids=("a",)):
        return {"runs": {"128": {"ours": {"step0": {"loss": ours, "window_ids": list(ids)}},
                                 "plain": {"step0": {"loss": plain, "window_ids": ["a"]}}}}}

    assert same_math(results(12.86185, 12.85599)) == []  # measured on one H200
    assert LOSS_TOLERANCE * 12.85599 < 0.06
    assert "more than" in same_math(results(12.95, 12.85599))[0]
    assert "step 0 read" in same_math(results(12.85599, 12.85599, ids=("b",)))[0]

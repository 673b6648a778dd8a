"""The Gated-DeltaNet kernel check: its comparison logic on CPU (torch on both sides), fla on a GPU."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

from conftest import scale_gradient
from videosft.kernels import gated_deltanet
from videosft.kernels.checks import CHECK_SHORT_TOKENS, RELATIVE_ERROR_BOUND, KernelCheckError

SHAPE = (1, 2, 8, 8)  # key heads, value heads (grouped), key dim, value dim
LENGTHS = [70]  # one full chunk of 64 and a partial one
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _convolution_restored(monkeypatch):
    """Selection also binds the packed-sample convolution into the modeling module: undone after each test."""
    monkeypatch.setattr(modeling, gated_deltanet.CONV_NAME, modeling.causal_conv1d_fn)


@pytest.fixture
def reference():
    return gated_deltanet.torch_reference(modeling.torch_chunk_gated_delta_rule)


def test_the_reference_unwraps_to_transformers_torch_function(reference):
    assert reference.__module__ == modeling.__name__ and reference.__name__ == gated_deltanet.NAME
    # our own wrappers unwrap to it too, so a second selection still compares against torch
    assert gated_deltanet.torch_reference(gated_deltanet.torch_implementation(reference)) is reference


def test_torch_in_bf16_passes_against_itself_in_fp32(reference):
    rows = gated_deltanet.check_gated_delta_rule(gated_deltanet.torch_implementation(reference), reference, [SHAPE], LENGTHS, CPU)
    assert [(r["tokens"], r["gate"]) for r in rows] == [(70, "init"), (70, "slow")]
    for row in rows:
        assert set(row["relative_errors"]) == {"out", "dquery", "dkey", "dvalue", "dg", "dbeta"}
        assert row["passed"] and row["max_relative_error"] < 5e-3  # only the bf16 rounding of outputs and gradients
        assert row["relative_errors"]["dg"] == 0.0  # g stays fp32 on both sides


def test_a_wrong_output_fails(reference):
    def off(query, key, value, g, beta, **kwargs):
        out, state = reference(query, key, value, g, beta, **kwargs)
        return out * 1.03, state

    rows = gated_deltanet.check_gated_delta_rule(off, reference, [SHAPE], LENGTHS, CPU)
    assert not any(r["passed"] for r in rows)
    assert all(r["relative_errors"]["out"] == pytest.approx(0.03, rel=0.1) for r in rows)


def test_a_wrong_gradient_alone_fails(reference):
    def wrong_dbeta(query, key, value, g, beta, **kwargs):  # the class of bug behind fla #640
        return reference(query, key, value, g, scale_gradient(beta, 1.05), **kwargs)

    rows = gated_deltanet.check_gated_delta_rule(wrong_dbeta, reference, [SHAPE], LENGTHS, CPU)
    for row in rows:
        assert not row["passed"]
        assert row["relative_errors"]["out"] < 5e-3 and row["relative_errors"]["dbeta"] > RELATIVE_ERROR_BOUND
        assert max(v for k, v in row["relative_errors"].items() if k != "dbeta") <= RELATIVE_ERROR_BOUND


def test_unknown_gate_regime_is_refused():
    with pytest.raises(ValueError, match="gate regime"):
        gated_deltanet.check_inputs(SHAPE, 8, "fast", CPU)


def _tiny_model():
    config = modeling.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1,
        linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    with torch.device("meta"):
        return modeling.Qwen3_5ForCausalLM(config)


def test_selection_on_cpu_binds_torch_and_says_why(monkeypatch):
    monkeypatch.setattr(modeling, gated_deltanet.NAME, modeling.torch_chunk_gated_delta_rule)  # restored afterwards
    monkeypatch.delenv(gated_deltanet.ENV, raising=False)
    record = gated_deltanet.select_gated_delta_rule(_tiny_model(), CPU, 500)
    assert record["implementation"] == "torch" and record["layer_shapes"] == [[1, 2, 8, 8]]
    assert record["reason"] in ("fla does not import", "no CUDA device")
    assert getattr(modeling, gated_deltanet.NAME).implementation == "torch"


def test_the_torch_paths_run_packed_samples_apart(monkeypatch):
    """Rule and convolution, given boundaries, equal each sample run alone; without them the second
    sample's output differs (the state leak the boundaries prevent), so the equality means something."""
    monkeypatch.setattr(modeling, gated_deltanet.NAME, modeling.torch_chunk_gated_delta_rule)
    gated_deltanet.select_gated_delta_rule(_tiny_model(), CPU, 500)
    rule, conv = getattr(modeling, gated_deltanet.NAME), getattr(modeling, gated_deltanet.CONV_NAME)
    inputs = gated_deltanet.check_inputs(SHAPE, 70, "slow", CPU)
    q, k, v, g, beta = (inputs[n].float() for n in ("query", "key", "value", "g", "beta"))
    bounds = torch.tensor([0, 50, 70])
    packed, state = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
    alone = [rule(*(t[:, a:b] for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0] for a, b in ((0, 50), (50, 70))]
    assert state is None
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=0)
    leaked = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    assert (leaked[:, 50:] - alone[1]).abs().max() > 1e-3
    hidden, weight = torch.randn(1, 6, 9), torch.randn(6, 4)
    packed = conv(hidden, weight, None, activation="silu", cu_seq_lens_q=torch.tensor([0, 4, 9]))
    alone = torch.cat([conv(hidden[..., :4], weight, None, activation="silu"),
                       conv(hidden[..., 4:], weight, None, activation="silu")], dim=-1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=0)
    assert (conv(hidden, weight, None, activation="silu")[..., 4:] - alone[..., 4:]).abs().max() > 1e-3


def test_asking_for_fla_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setattr(modeling, gated_deltanet.NAME, modeling.torch_chunk_gated_delta_rule)
    monkeypatch.setenv(gated_deltanet.ENV, "fla")
    with pytest.raises(KernelCheckError, match="cannot run here"):
        gated_deltanet.select_gated_delta_rule(_tiny_model(), CPU, 500)
    monkeypatch.setenv(gated_deltanet.ENV, "fast")
    with pytest.raises(ValueError, match="choose one of"):
        gated_deltanet.select_gated_delta_rule(_tiny_model(), CPU, 500)


def test_a_model_without_linear_attention_needs_no_choice():
    assert gated_deltanet.select_gated_delta_rule(torch.nn.Linear(2, 2), CPU, 10)["implementation"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU; the CPU tests above "
                    "check the comparison with the torch implementation on both sides")
def test_fla_matches_torch_at_qwen35_4b_shape(reference):
    if not gated_deltanet.fla_status()["importable"]:
        pytest.skip(f"fla does not import: {gated_deltanet.fla_status()['error']}")
    gated_deltanet.bypass_hopper_guard()
    rows = gated_deltanet.check_gated_delta_rule(gated_deltanet.fla_implementation(reference), reference, [(16, 32, 128, 128)],
                                          [1000, CHECK_SHORT_TOKENS], torch.device("cuda"))
    assert all(r["passed"] for r in rows), rows

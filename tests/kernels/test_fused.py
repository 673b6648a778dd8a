"""Fused elementwise kernels: discovery, the check and the binding on CPU (fla's own kernels need a GPU)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

from conftest import scale_gradient
from videosft.kernels import fused
from videosft.kernels.checks import CHECK_SHORT_TOKENS, RELATIVE_ERROR_BOUND, KernelCheckError
from videosft.kernels.gated_deltanet import CONV_NAME

CPU = torch.device("cpu")
LENGTHS = [40, 7]
PROJECT = Path(__file__).resolve().parents[2]
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1,
            linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """Each test starts from transformers' own convolution and without the switch in the environment."""
    monkeypatch.setattr(modeling, CONV_NAME, modeling.causal_conv1d_fn)  # restored afterwards
    monkeypatch.delenv(fused.ENV, raising=False)


def _tiny_qwen35(device="meta", **overrides):
    with torch.device(device):
        return modeling.Qwen3_5ForCausalLM(modeling.Qwen3_5TextConfig(**{**TEXT, **overrides}))


def _counts(sites):
    counts = dict.fromkeys(fused.KINDS, 0)
    for site in sites:
        counts[site.kind] += 1
    return counts


def _instance_forwards(model):
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


# ---------------------------------------------------------------- choosing


def test_torch_and_auto_on_cpu_leave_every_forward_untouched(monkeypatch):
    model, transformers_conv = _tiny_qwen35(), modeling.causal_conv1d_fn
    for requested in ("auto", "torch"):
        record = fused.select_fused_kernels(model, CPU, 500, requested)
        assert record["implementation"] == {"rms_norm_zero_centered": "torch", "rms_norm": None,
                                            "rms_norm_gated": "torch", "swiglu": "torch", "causal_conv1d": "torch"}
        assert record["modules"] == {"rms_norm_zero_centered": 7, "rms_norm": 0, "rms_norm_gated": 1, "swiglu": 2,
                                     "causal_conv1d": 1}
        assert set(record["replaced"].values()) == {0} and "checks" not in record
        reasons = ("asked for",) if requested == "torch" else ("fla does not import", "no CUDA device")
        assert record["reason"] in reasons
        assert _instance_forwards(model) == [] and modeling.causal_conv1d_fn is transformers_conv
        json.dumps(record)  # goes into the run record as is
    monkeypatch.setenv(fused.ENV, "torch")  # the switch overrides the argument
    record = fused.select_fused_kernels(model, CPU, 500, "fla")
    assert record["requested"] == "torch" and record["requested_by"] == fused.ENV


def test_asking_for_fla_where_it_cannot_run_is_an_error(monkeypatch):
    with pytest.raises(KernelCheckError, match="cannot run here"):
        fused.select_fused_kernels(_tiny_qwen35(), CPU, 500, "fla")
    monkeypatch.setenv(fused.ENV, "fast")
    with pytest.raises(ValueError, match=f"{fused.ENV}='fast': choose one of"):
        fused.select_fused_kernels(_tiny_qwen35(), CPU, 500)


def test_a_model_without_those_modules_needs_no_choice():
    record = fused.select_fused_kernels(torch.nn.Sequential(torch.nn.Linear(2, 2)), CPU, 10)
    assert record["implementation"] == dict.fromkeys(fused.KINDS) and "reason" in record


# ---------------------------------------------------------------- discovery


def test_discovery_finds_every_module_of_a_tiny_qwen35():
    sites, unrecognized = fused.find_sites(_tiny_qwen35())
    assert unrecognized == {}
    by_name = {site.name: site for site in sites}
    assert sorted(by_name) == sorted([
        "norm", "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "layers.1.input_layernorm",
        "layers.1.post_attention_layernorm", "layers.1.self_attn.q_norm", "layers.1.self_attn.k_norm",
        "layers.0.linear_attn.norm", "layers.0.mlp", "layers.1.mlp", "layers.0.linear_attn"])
    assert {by_name[n].kind for n in ("norm", "layers.1.self_attn.q_norm")} == {"rms_norm_zero_centered"}
    assert by_name["layers.0.linear_attn.norm"].kind == "rms_norm_gated"
    assert by_name["layers.0.linear_attn.norm"].eps_attribute == "variance_epsilon"
    assert by_name["norm"].eps_attribute == "eps"
    # norms over heads see tokens x heads rows: 2 query heads, 1 key head, 2 value heads
    assert [by_name[f"layers.1.self_attn.{n}"].shape for n in ("q_norm", "k_norm")] == [
        {"dim": 16, "eps": 1e-6, "rows_per_token": 2}, {"dim": 16, "eps": 1e-6, "rows_per_token": 1}]
    assert by_name["layers.0.linear_attn.norm"].shape == {"dim": 8, "eps": 1e-6, "rows_per_token": 2}
    assert by_name["layers.0.mlp"].shape == {"intermediate": 64}
    assert by_name["layers.0.linear_attn"].shape == {"channels": 32, "width": 4, "bias": False, "activation": "silu"}
    assert by_name["layers.0.linear_attn"].modeling is modeling
    assert len(fused.distinct_sites(sites)) == 6  # hidden norm, q_norm, k_norm, gated norm, MLP, convolution


def test_discovery_searches_the_language_model_only():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig
    from transformers import Qwen3VLForConditionalGeneration

    qwen25 = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1]))
    qwen3vl = Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]))
    with torch.device("meta"):
        models = {"qwen25": Qwen2_5_VLForConditionalGeneration(qwen25),
                  "qwen3vl": Qwen3VLForConditionalGeneration(qwen3vl)}
    for name, model in models.items():
        sites, unrecognized = fused.find_sites(model)
        vision = {id(m) for m in model.model.visual.modules()}
        assert not any(id(site.module) in vision for site in sites), name
        assert unrecognized == {}
        # 2 layer norms per layer + the final one; Qwen3-VL adds q_norm and k_norm per layer
        expected_norms = 5 if name == "qwen25" else 9
        assert _counts(sites) == {"rms_norm_zero_centered": 0, "rms_norm": expected_norms, "rms_norm_gated": 0,
                                  "swiglu": 2, "causal_conv1d": 0}, name
    # the vision tower of Qwen2.5-VL has the same RMSNorm class and a SiLU-gated MLP: left alone
    assert any(type(m).__name__ == "Qwen2_5_VLRMSNorm" for m in models["qwen25"].model.visual.modules())


def test_discovery_goes_by_behaviour_not_by_class_name():
    sites, unrecognized = fused.find_sites(_tiny_qwen35(hidden_act="gelu"))
    counts = _counts(sites)
    assert counts["swiglu"] == 0 and counts["causal_conv1d"] == 0  # fla has SiLU only
    assert unrecognized == {"Qwen3_5MLP": 2, "Qwen3_5GatedDeltaNet": 1}
    assert counts["rms_norm_zero_centered"] == 7 and counts["rms_norm_gated"] == 1

    class PlainUnderAZeroCenteredName(modeling.Qwen3_5RMSNorm):
        def forward(self, x):
            return (self._norm(x.float()) * self.weight.float()).type_as(x)

    class OtherEps(modeling.Qwen3_5RMSNorm):
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)

    assert fused.probe_norm(PlainUnderAZeroCenteredName(16), 16, 1e-6) == "rms_norm"
    assert fused.probe_norm(modeling.Qwen3_5RMSNorm(16), 16, 1e-6) == "rms_norm_zero_centered"
    assert fused.probe_norm(OtherEps(16), 16, 1e-6) is None
    assert fused.probe_norm(torch.nn.LayerNorm(16, bias=False), 16, 1e-5) is None


# ---------------------------------------------------------------- the check


def test_the_torch_emulation_in_bf16_passes_against_the_originals_in_fp32():
    sites, _ = fused.find_sites(_tiny_qwen35())
    rows = fused.check_sites(sites, fused.torch_kernels(), LENGTHS, CPU)
    assert len(rows) == 6 * len(LENGTHS)
    gradients = {"rms_norm_zero_centered": {"dhidden_states", "dweight"},
                 "rms_norm_gated": {"dhidden_states", "dgate", "dweight"}, "swiglu": {"dgate", "dup"},
                 "causal_conv1d": {"dhidden_states", "dweight"}}
    for row in rows:
        assert set(row["relative_errors"]) == {"out"} | gradients[row["kernel"]]
        assert row["passed"] and row["max_relative_error"] < 5e-3  # one bf16 rounding of each result
        assert row["bound"] == RELATIVE_ERROR_BOUND
    json.dumps(rows)


def test_weight_instead_of_one_plus_weight_fails_and_names_the_kernel():
    sites, _ = fused.find_sites(_tiny_qwen35())
    wrong = fused.torch_kernels()
    right_rms_norm = wrong["rms_norm"]
    wrong["rms_norm"] = lambda x, weight, bias, **kwargs: right_rms_norm(x, weight - 1, bias, **kwargs)
    rows = fused.check_sites(sites, wrong, [40], CPU)
    for row in rows:
        assert row["passed"] == (row["kernel"] != "rms_norm_zero_centered")
        if not row["passed"]:
            assert row["relative_errors"]["out"] > 0.1
    with pytest.raises(KernelCheckError, match=r"rms_norm_zero_centered \(videosft\.kernels\.norms\.rms_norm"
                                               r".*Qwen3_5RMSNorm at dim=32.*VIDEOSFT_FUSED_KERNELS=torch"):
        fused.check_and_bind(sites, wrong, CPU, 40, "torch emulation")
    # nothing was bound
    assert not any("forward" in vars(site.module) for site in sites)
    assert not hasattr(modeling.causal_conv1d_fn, "fused_kind")


def test_check_and_bind_binds_what_passed_and_records_it():
    sites, _ = fused.find_sites(_tiny_qwen35())
    record = fused.check_and_bind(sites, fused.torch_kernels(), CPU, 40, "torch emulation")
    assert record["implementation"] == {"rms_norm_zero_centered": "torch emulation", "rms_norm": None,
                                        "rms_norm_gated": "torch emulation", "swiglu": "torch emulation",
                                        "causal_conv1d": "torch emulation"}
    assert record["replaced"] == _counts(sites) and all(row["passed"] for row in record["checks"])
    # one length: 40 tokens is shorter than the short check (201)
    assert [row["tokens"] for row in record["checks"]] == [40] * len(fused.distinct_sites(sites))
    assert all(site.module.forward.implementation == "torch emulation"
               for site in sites if site.kind != "causal_conv1d")
    json.dumps(record)


def test_a_kernel_that_raises_in_the_check_is_an_error_and_binds_nothing():
    sites, _ = fused.find_sites(_tiny_qwen35())
    kernels = fused.torch_kernels()

    def does_not_compile(*args, **kwargs):
        raise RuntimeError("no Triton for this shape")

    kernels["swiglu"] = does_not_compile
    with pytest.raises(KernelCheckError, match="raised RuntimeError: no Triton for this shape.*=torch"):
        fused.check_and_bind(sites, kernels, CPU, 40, "torch emulation")
    assert not any("forward" in vars(site.module) for site in sites)


def test_a_wrong_gradient_alone_fails():
    sites, _ = fused.find_sites(_tiny_qwen35())
    mlp = [site for site in sites if site.kind == "swiglu"][:1]
    kernels = fused.torch_kernels()
    right_swiglu = kernels["swiglu"]
    kernels["swiglu"] = lambda x, y: right_swiglu(x, scale_gradient(y, 1.05))
    (row,) = fused.check_sites(mlp, kernels, [40], CPU)
    assert not row["passed"] and row["relative_errors"]["dup"] == pytest.approx(0.05, rel=0.1)
    assert row["relative_errors"]["out"] < 5e-3 and row["relative_errors"]["dgate"] < 5e-3


# ---------------------------------------------------------------- binding


def test_a_bound_forward_reads_the_weight_when_called_as_under_zero3():
    holder = torch.nn.Module()
    holder.norm = modeling.Qwen3_5RMSNorm(32)
    # ZeRO-3: the parameter is an empty partition outside the forward; a pre-forward hook gathers it
    gathered = {"weight": torch.randn(32) * 0.5}
    holder.norm.weight.data = torch.empty(0)
    holder.norm.weight.ds_shape = torch.Size([32])
    holder.norm.register_forward_pre_hook(lambda module, args: setattr(module.weight, "data", gathered["weight"]))
    holder.norm.register_forward_hook(lambda module, args, out: setattr(module.weight, "data", torch.empty(0)))
    sites, _ = fused.find_sites(holder)
    assert [(s.kind, s.shape["dim"]) for s in sites] == [("rms_norm_zero_centered", 32)]
    assert fused.bind(sites, fused.torch_kernels(), "torch emulation")["rms_norm_zero_centered"] == 1
    x = torch.randn(3, 32)
    for _ in range(2):
        expected = modeling.Qwen3_5RMSNorm.forward(fused.stand_in(holder.norm, {"weight": gathered["weight"]}), x)
        torch.testing.assert_close(holder.norm(x), expected)
        assert holder.norm.weight.numel() == 0  # released again after the forward
        gathered["weight"] = torch.randn(32) * 0.5  # a new value is read by the next call
    assert holder.norm.forward.implementation == "torch emulation"


def test_a_bound_model_computes_what_the_original_does_and_torch_unbinds_it():
    torch.manual_seed(0)
    model = _tiny_qwen35(device="cpu")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # built as zeros / ones, which would hide w vs 1 + w
                parameter.add_(torch.randn_like(parameter) * 0.3)
    ids, weights = torch.randint(0, 64, (2, 12)), torch.randn(2, 12, 64)

    def logits_and_gradients():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected_logits, expected_gradients = logits_and_gradients()
    sites, _ = fused.find_sites(model)
    counts = fused.bind(sites, fused.torch_kernels(), "torch emulation")
    assert counts == {"rms_norm_zero_centered": 7, "rms_norm": 0, "rms_norm_gated": 1, "swiglu": 2,
                      "causal_conv1d": 1}
    assert modeling.causal_conv1d_fn.implementation == "torch emulation" and len(_instance_forwards(model)) == 10
    logits, gradients = logits_and_gradients()
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)
    assert gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], rtol=1e-4, atol=1e-5, msg=name)

    transformers_conv = modeling.causal_conv1d_fn.replaced
    fused.select_fused_kernels(model, CPU, 12, "torch")
    assert _instance_forwards(model) == [] and modeling.causal_conv1d_fn is transformers_conv


def test_the_fused_mlp_keeps_calling_lora_wrapped_projections():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_tiny_qwen35(device="cpu"), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                                  target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # built as zeros, which would hide a forward that skipped the adapter
                parameter.normal_(0, 0.5)
    ids = torch.randint(0, 64, (1, 9))
    expected = model(input_ids=ids).logits
    sites, _ = fused.find_sites(model)  # through the PeftModel, to the language model
    mlps = [site for site in sites if site.kind == "swiglu"]
    assert len(mlps) == 2 and type(mlps[0].module.gate_proj).__module__.startswith("peft")
    fused.bind(sites, fused.torch_kernels(), "torch emulation")
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_a_forward_already_on_the_instance_is_not_dropped():
    model = _tiny_qwen35(device="cpu")
    hooked = model.model.layers[1].mlp
    hooked.forward = lambda x: x  # as accelerate's hooks do
    sites, _ = fused.find_sites(model)
    with pytest.raises(ValueError, match="layers.1.mlp .*already has its own forward"):
        fused.bind(sites, fused.torch_kernels(), "torch emulation")
    assert _instance_forwards(model) == ["model.layers.1.mlp"]  # nothing else bound either


def test_the_fused_convolution_passes_packed_boundaries_on_and_refuses_other_activations():
    kernels = fused.torch_kernels()
    reference = inspect.unwrap(modeling.causal_conv1d_fn)
    conv = fused.causal_conv1d_forward(reference, kernels["causal_conv1d"])
    hidden, weight = torch.randn(1, 8, 5), torch.randn(8, 4)
    torch.testing.assert_close(conv(hidden, weight, None, activation="silu"),
                               reference(hidden, weight, None, activation="silu"))
    packed = conv(hidden, weight, None, activation="silu", cu_seq_lens_q=torch.tensor([0, 2, 5]))
    alone = torch.cat([reference(hidden[..., :2], weight, None, activation="silu"),
                       reference(hidden[..., 2:], weight, None, activation="silu")], dim=-1)
    torch.testing.assert_close(packed, alone)
    assert not torch.allclose(packed, reference(hidden, weight, None, activation="silu"))  # the boundary counts
    with pytest.raises(ValueError, match="seq_idx"):
        conv(hidden, weight, None, activation="silu", seq_idx=torch.tensor([0, 0, 1, 1, 1]))
    with pytest.raises(ValueError, match="silu or no activation"):
        conv(hidden, weight, None, activation="gelu")


# ---------------------------------------------------------------- standalone check


def test_main_checks_a_model_config_on_cpu_with_the_emulation(tmp_path, capsys):
    config = modeling.Qwen3_5Config(
        text_config=TEXT, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=32, num_position_embeddings=16))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    assert fused.main(["--model-config", str(path), "--tokens", "16", "7", "--device", "cpu", "--time"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["candidate"] == "torch emulation" and len(result["checks"]) == 12
    assert result["modules"]["rms_norm_zero_centered"] == 7 and all(row["passed"] for row in result["checks"])
    timings = result["milliseconds_forward_backward"]
    assert [t["kernel"] for t in timings] == [row["kernel"] for row in result["checks"][::2]]
    assert all(t["tokens"] == 16 and t["fused"] > 0 and t["original"] > 0 for t in timings)
    # timed as training runs it: what the modeling module binds (transformers' function, or once a
    # Gated-DeltaNet selection ran in this process, videosft.kernels.gated_deltanet's per-sample wrapper of it)
    bound = modeling.causal_conv1d_fn
    assert inspect.unwrap(bound).__module__ == modeling.__name__
    assert {t["original_is"] for t in timings if t["kernel"] == "causal_conv1d"} == {
        f"{bound.__module__}.{bound.__qualname__}"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU; the CPU tests above "
                    "check the machinery with a torch emulation of fla's functions")
@pytest.mark.parametrize("config", ["Qwen3.5-4B.json", "Qwen3-VL-8B-Instruct.json"])
def test_fla_matches_transformers_at_published_shapes(config):
    status = fused.fla_status()
    if not status["importable"]:
        pytest.skip(f"fla does not import: {status['error']}")
    sites, _ = fused.find_sites(fused.build_meta_model(PROJECT / "bench" / "configs" / config))
    rows = fused.check_sites(sites, fused.fla_kernels(), [1000, CHECK_SHORT_TOKENS], torch.device("cuda"))
    assert {row["kernel"] for row in rows} >= {"swiglu"}
    assert all(row["passed"] for row in rows), [row for row in rows if not row["passed"]]

"""The memory planner's arithmetic, checked by hand on round numbers."""

from __future__ import annotations

import pytest
from videosft import config as config_lib

from videosft.training.memory import GIB, RESERVED_OVER_ALLOCATED, ModelFacts, SampleFacts, largest_frames, micro_batch, plan_peak, sample_at_frames, flowchart

MODEL = ModelFacts(parameters=4_000_000_000, vision_parameters=400_000_000, largest_layer_parameters=100_000_000,
                   embedding_parameters=600_000_000, lm_head_parameters=0, small_parameters=1_000_000, layers=32,
                   hidden=2560, intermediate=9216, attention_width=8192, vocab=248_320, vision_hidden=1024,
                   vision_intermediate=4096, vision_heads=16, merge=2)
SAMPLE = SampleFacts(input_tokens=6_600, visual_tokens=6_272, supervised_tokens=180, frames=64)
ZERO = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000,
        "reduce_bucket_size": 500_000_000, "stage3_param_persistence_threshold": 1_000_000}


@pytest.fixture(autouse=True)
def planned_for_torch_kernels(monkeypatch):
    """The arithmetic below is checked with the torch kernels' coefficients, whether or not
    flash-linear-attention is installed where the tests run."""
    monkeypatch.setenv("VIDEOSFT_GATED_DELTANET", "torch")


def test_the_plan_takes_the_kernels_this_environment_will_bind(monkeypatch):
    import importlib.util

    from videosft.training.memory import planned_kernels

    assert planned_kernels() == "torch"  # asked for by the environment variable
    monkeypatch.delenv("VIDEOSFT_GATED_DELTANET")
    real = importlib.util.find_spec
    for installed, expected in ((True, "fla"), (False, "torch")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, installed=installed: (real("json") if installed else None)
                            if name == "fla" else real(name, *a))
        assert planned_kernels() == expected
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real("json") if name == "fla" else real(name, *a))
    assert planned_kernels("torch") == "fla-unfused"  # train.fused_kernels: torch


def test_components_follow_the_lecture_and_zero3():
    plan = plan_peak(MODEL, SAMPLE, trainable=10_000_000, world=2, ds_zero=ZERO)
    parts = {k: v * GIB for k, v in plan["components_gib"].items()}
    assert parts["weights_partitioned"] == pytest.approx(4e9 * 2 / 2)  # bf16, halved by two ranks
    assert parts["lora_weights_grads_adam"] == pytest.approx(10e6 * 20 / 2)  # 20 bytes per trainable parameter
    assert parts["gathered_working_set"] == pytest.approx((600e6 + 50e6) * 2)  # the embedding is the largest block
    assert parts["logits"] == pytest.approx(180 * 248_320 * (2 + 8))  # supervised positions only
    assert plan["reserved_gib"] == pytest.approx(plan["allocated_gib"] * RESERVED_OVER_ALLOCATED)
    assert plan["allocated_gib"] == pytest.approx(sum(plan["components_gib"].values()))


def test_one_rank_gathers_nothing_unless_its_weights_are_on_the_host():
    on_gpu = plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO, whole_blocks=True)["components_gib"]
    on_host = plan_peak(MODEL, SAMPLE, 10_000_000, 1, {**ZERO, "offload_param": {"device": "cpu"}},
                        whole_blocks=True)["components_gib"]
    assert on_gpu["gathered_working_set"] == 0 and on_gpu["weights_partitioned"] * GIB == pytest.approx(8e9)
    assert on_host["gathered_working_set"] * GIB == pytest.approx((600e6 + 100e6) * 2)  # copied to the GPU


def test_more_ranks_less_memory_and_full_logits_cost_more():
    one = plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO)["allocated_gib"]
    four = plan_peak(MODEL, SAMPLE, 10_000_000, 4, ZERO)["allocated_gib"]
    assert four < one
    full = plan_peak(MODEL, SAMPLE, 10_000_000, 2, ZERO, sliced_logits=False)["components_gib"]["logits"]
    sliced = plan_peak(MODEL, SAMPLE, 10_000_000, 2, ZERO)["components_gib"]["logits"]
    assert full == pytest.approx(sliced * 6_600 / 180)


def test_frames_scale_the_visual_tokens_and_the_largest_count_fits():
    doubled = sample_at_frames(SAMPLE, 128)
    assert doubled.visual_tokens == 2 * SAMPLE.visual_tokens
    assert doubled.input_tokens - doubled.visual_tokens == SAMPLE.input_tokens - SAMPLE.visual_tokens
    frames = largest_frames(MODEL, SAMPLE, 10_000_000, 2, ZERO, limit_gib=12.0, step=16)
    assert frames % 16 == 0 and frames > 0
    assert plan_peak(MODEL, sample_at_frames(SAMPLE, frames), 10_000_000, 2, ZERO)["reserved_gib"] <= 12.0
    assert plan_peak(MODEL, sample_at_frames(SAMPLE, frames + 16), 10_000_000, 2, ZERO)["reserved_gib"] > 12.0


def test_the_plan_sizes_the_largest_micro_batch_padded_or_packed():
    assert micro_batch(SAMPLE) == SAMPLE
    padded = micro_batch(SAMPLE, micro_batch_size=3)
    assert (padded.input_tokens, padded.visual_tokens, padded.supervised_tokens, padded.frames) == (
        19_800, 18_816, 540, 192)
    pack = micro_batch(SAMPLE, pack_tokens=16_500)  # 2.5 samples of the longest one's mix
    assert (pack.input_tokens, pack.visual_tokens, pack.supervised_tokens, pack.frames) == (16_500, 15_680, 450, 160)
    one, three, packed = (plan_peak(MODEL, s, 10_000_000, 2, ZERO) for s in (SAMPLE, padded, pack))
    assert one["reserved_gib"] < packed["reserved_gib"] < three["reserved_gib"]
    # the vision tower attends within a frame pair: packing more pairs adds patches, not a longer attention
    assert pack.visual_tokens / (pack.frames // 2) == SAMPLE.visual_tokens / (SAMPLE.frames // 2)


def test_the_largest_frame_count_is_per_sample_under_the_micro_batch_and_the_pack_budget():
    alone = largest_frames(MODEL, SAMPLE, 10_000_000, 2, ZERO, limit_gib=12.0, step=16)
    three = largest_frames(MODEL, SAMPLE, 10_000_000, 2, ZERO, limit_gib=12.0, step=16, micro_batch_size=3)
    assert 0 < three < alone
    assert plan_peak(MODEL, micro_batch(sample_at_frames(SAMPLE, three), 3), 10_000_000, 2, ZERO)["reserved_gib"] <= 12
    # a pack of 8,000 tokens takes samples of at most 8,000 tokens, however much memory is left
    frames = largest_frames(MODEL, SAMPLE, 10_000_000, 2, ZERO, limit_gib=1000.0, step=16, pack_tokens=8_000)
    assert sample_at_frames(SAMPLE, frames).input_tokens <= 8_000 < sample_at_frames(SAMPLE, frames + 16).input_tokens


def test_flowchart_walks_the_lecture_steps():
    steps = flowchart(MODEL, SAMPLE, 10_000_000, 2, ZERO, limit_gib=12.0)
    assert steps[0]["answer"] == "bf16"
    assert steps[1]["answer"] == "does not fit"  # 4B x 16 bytes alone is 60 GiB
    assert steps[-1]["question"].startswith("LoRA") and steps[-1]["predicted_gib"] < steps[2]["predicted_gib"]
    assert flowchart(MODEL, SAMPLE, 10_000_000, 2, ZERO, 12.0, bf16_supported=False)[0]["answer"] == "fp16"


def test_adapters_are_fp32_and_the_whole_model_trains_at_the_lectures_16_bytes():
    lora = plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO, zero3_on_one_rank=True)["components_gib"]
    assert lora["lora_weights_grads_adam"] * GIB == pytest.approx(10e6 * (4 + 4 + 12))  # fp32 weight and gradient
    full = plan_peak(MODEL, SAMPLE, 4_000_000_000, 1, ZERO, trainable_bytes=2 + 12)["components_gib"]
    assert (full["weights_partitioned"] + full["lora_weights_grads_adam"]) * GIB == pytest.approx(4e9 * 16)
    steps = flowchart(MODEL, SAMPLE, 10_000_000, 2, ZERO, limit_gib=12.0)
    no_checkpointing = plan_peak(MODEL, SAMPLE, 4_000_000_000, 1, ZERO, checkpointing=False, trainable_bytes=14)
    assert steps[1]["predicted_gib"] == pytest.approx(no_checkpointing["reserved_gib"])


def test_one_rank_without_zero_plans_no_master_copy_and_no_reduce_bucket():
    """The train stage runs one rank without ZeRO (memory.whole_on_one_rank): the optimizer steps the fp32
    adapters themselves; fp16, an offload or train.zero3_on_one_rank keep ZeRO-3 and its terms."""
    whole = plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO)["components_gib"]
    assert whole["lora_weights_grads_adam"] * GIB == pytest.approx(10e6 * (4 + 4 + 8))
    assert whole["gradient_reduce_buffer"] == 0
    for world, zero, options in ((1, ZERO, {"zero3_on_one_rank": True}), (1, ZERO, {"precision": "fp16"}),
                                 (1, {**ZERO, "offload_optimizer": {"device": "cpu"}}, {}), (2, ZERO, {})):
        kept = plan_peak(MODEL, SAMPLE, 10_000_000, world, zero, **options)["components_gib"]
        p = 4 if options.get("precision") == "fp32" else 2
        assert kept["lora_weights_grads_adam"] * GIB == pytest.approx(10e6 * 20 / world), (world, zero, options)
        assert kept["gradient_reduce_buffer"] * GIB == pytest.approx((500e6 + 10e6) * p), (world, zero, options)


def test_offloading_takes_weights_and_checkpointed_inputs_off_the_gpu():
    base = plan_peak(MODEL, SAMPLE, 10_000_000, 2, ZERO)["components_gib"]
    offloaded = plan_peak(MODEL, SAMPLE, 10_000_000, 2, {**ZERO, "offload_param": {"device": "cpu"}},
                          offload_activations=True)["components_gib"]
    assert offloaded["weights_partitioned"] == 0 and base["weights_partitioned"] * GIB == pytest.approx(4e9)
    assert offloaded["offload_staging"] * GIB == pytest.approx(600e6 * 2 / 2) and base["offload_staging"] == 0
    # 32 checkpointed layer inputs of 6,600 x 2,560 bf16 values; one stays for its recomputation
    saved = (base["activations_checkpointed_layers"] - offloaded["activations_checkpointed_layers"]) * GIB
    assert saved == pytest.approx(31 * 6_600 * 2_560 * 2)
    options = {"checkpointing": True, "offload_activations": True}
    more = largest_frames(MODEL, SAMPLE, 10_000_000, 2, {**ZERO, "offload_param": {"device": "cpu"}}, 12.0,
                          step=16, **options)
    assert more > largest_frames(MODEL, SAMPLE, 10_000_000, 2, ZERO, 12.0, step=16)


def test_uncheckpointed_layers_keep_their_forward_in_place_of_their_input():
    """train.uncheckpointed_layers n: n layers hold their whole forward's activations (the projections' outputs)
    instead of their input; n = every layer is the plan without checkpointing; the probe names the most that
    fit its card, and none without checkpointing."""
    from videosft.training.memory import most_uncheckpointed_layers

    def activations(**options):
        return plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO, **options)["components_gib"][
            "activations_checkpointed_layers"] * GIB

    layer_forward = 6_600 * 2 * (8192 + 3 * 9216 + 4 * 2560)
    layer_input = 6_600 * 2560 * 2
    assert activations(uncheckpointed_layers=3) - activations() == pytest.approx(3 * (layer_forward - layer_input))
    assert activations(uncheckpointed_layers=32) == activations(checkpointing=False) == \
        pytest.approx(32 * layer_forward)
    # offloaded inputs: one comes back at a time, whatever number of layers is checkpointed
    assert activations(uncheckpointed_layers=3, offload_activations=True) == pytest.approx(
        activations(offload_activations=True) + 3 * layer_forward)
    checkpointed = plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO)["reserved_gib"]
    limit = checkpointed + 5.5 * (layer_forward - layer_input) * RESERVED_OVER_ALLOCATED / GIB
    assert most_uncheckpointed_layers(MODEL, SAMPLE, 10_000_000, 1, ZERO, limit) == 5
    assert most_uncheckpointed_layers(MODEL, SAMPLE, 10_000_000, 1, ZERO, checkpointed - 0.1) == 0
    assert most_uncheckpointed_layers(MODEL, SAMPLE, 10_000_000, 1, ZERO, 1000.0) == 32
    assert most_uncheckpointed_layers(MODEL, SAMPLE, 10_000_000, 1, ZERO, 1000.0, checkpointing=False) is None


def test_adapters_keep_an_fp32_copy_of_their_input_where_the_model_computes_in_bf16():
    from videosft.training.memory import AdapterInputs, adapter_bytes

    assert adapter_bytes(1000, "bf16", 0.0) == 4000  # the fp32 copy
    assert adapter_bytes(1000, "bf16", 0.05) == 5000  # the dropped-out copy and its mask
    assert adapter_bytes(1000, "fp32", 0.0) == 0  # the adapters read the layer's own tensor
    assert adapter_bytes(1000, "fp32", 0.05) == 5000
    # the coefficients' own LoRA adds nothing; more adapted inputs add their bytes, layer by layer
    assert AdapterInputs((0, 5120), (0, 5120), 0.05).extra("bf16") == (0, 0)
    assert AdapterInputs((28672, 26112), (0, 5120), 0.05).extra("bf16") == (143360, 104960)
    assert AdapterInputs((28672, 26112), (0, 5120), 0.0).extra("bf16") == (114688, 104448 - 25600)


def test_the_adapters_extra_bytes_live_as_long_as_their_layer_s_activations():
    """A checkpointed layer's adapters hold their copies while that layer is recomputed (the largest of them
    counts); an uncheckpointed layer's all through; without checkpointing, every layer's."""
    def copies(**options):
        plan = plan_peak(MODEL, SAMPLE, 10_000_000, 1, ZERO, **options)
        assert plan["allocated_gib"] == pytest.approx(sum(plan["components_gib"].values()))
        return plan["components_gib"]["lora_input_copies"] * GIB

    extra = tuple([100.0, 100.0, 100.0, 300.0] * 8)  # bytes a token: three layers of one type, one of another
    tokens = 6_600
    assert copies() == 0 and copies(adapter_extra=tuple([0.0] * 32)) == 0
    assert copies(adapter_extra=extra) == pytest.approx(tokens * 300)
    # the last two layers', and the largest checkpointed one's
    assert copies(adapter_extra=extra, uncheckpointed_layers=2) == pytest.approx(tokens * (100 + 300 + 300))
    assert copies(adapter_extra=extra, checkpointing=False) == pytest.approx(tokens * sum(extra))


def test_whole_blocks_gather_past_the_live_limit_beside_the_embedding():
    capped = {**ZERO, "stage3_max_live_parameters": 100_000_000}
    per_module = plan_peak(MODEL, SAMPLE, 10_000_000, 2, capped)["components_gib"]["gathered_working_set"]
    whole = plan_peak(MODEL, SAMPLE, 10_000_000, 2, capped, whole_blocks=True)["components_gib"]
    assert per_module * GIB == pytest.approx(100e6 * 2)  # the live limit caps per-module gathering
    assert whole["gathered_working_set"] * GIB == pytest.approx((600e6 + 100e6) * 2)  # embedding + a layer
    assert largest_frames(MODEL, SAMPLE, 10_000_000, 2, capped, 12, whole_blocks=True) < \
        largest_frames(MODEL, SAMPLE, 10_000_000, 2, capped, 12)


def test_the_run_plans_with_the_kernels_it_bound():
    from videosft.training.memory import COEFFICIENTS
    from videosft.training.memory import kernel_set

    def bound(gdn, fused):
        return {"gated_deltanet": {"implementation": gdn}, "fused": {"implementation": {"rms_norm": fused}}}

    assert kernel_set(bound("fla", "fla")) == "fla"
    assert kernel_set(bound("fla", "torch")) == "fla-unfused"
    assert kernel_set(bound(None, "fla")) == "fla"  # Qwen3-VL: no Gated-DeltaNet, fused norms
    assert kernel_set(bound("torch", "fla")) == "torch"  # the fallback's fp32 intermediates dominate
    assert kernel_set(bound(None, "torch")) == "torch"
    factors = {name: COEFFICIENTS[name][0] for name in ("torch", "fla-unfused", "fla")}
    assert factors["torch"] > factors["fla-unfused"] > factors["fla"]  # fused kernels keep the least


def test_the_train_record_plans_a_padded_micro_batch_whole():
    import dataclasses
    import types

    from videosft.training.memory import PlanOptions, memory_comparison

    probe = {"memory": {"model_facts": dataclasses.asdict(MODEL)}, "lora": {"trainable_parameters": 10_000_000}}
    index = [types.SimpleNamespace(**{key: getattr(SAMPLE, key) for key in
                                      ("input_tokens", "visual_tokens", "supervised_tokens", "frames")})]
    train_cfg = config_lib.section("train", {"micro_batch_size": 3, "gradient_checkpointing": True,
                                             "offload_activations": False, "gather_whole_blocks": False})
    options = PlanOptions.of(train_cfg, precision="bf16", kernels="torch")
    got = memory_comparison(probe, index, 2, ZERO, options, [[{"peak_allocated_gib": 1.0}], []])
    assert got["predicted"] == plan_peak(MODEL, micro_batch(SAMPLE, 3), 10_000_000, 2, ZERO, "bf16", kernels="torch")
    assert got["predicted"]["reserved_gib"] > plan_peak(MODEL, SAMPLE, 10_000_000, 2, ZERO, kernels="torch")["reserved_gib"]


def test_a_sequence_shared_by_n_ranks_holds_its_share_of_tokens_and_frames_on_each():
    """train.sequence_parallel: a rank's slice is 1/n of the tokens plus at most one frame pair; the
    weights stay partitioned over the world; the all-to-alls add a send and a receive copy of one layer's
    query, key and value slice; the supervised logits stay whole (the answer may all be on one rank)."""
    one, two = (plan_peak(MODEL, SAMPLE, trainable=10_000_000, world=2, ds_zero=ZERO, sequence_parallel=n)
                for n in (1, 2))
    a, b = ({k: v * GIB for k, v in plan["components_gib"].items()} for plan in (one, two))
    pair = 6_272 / 32  # visual tokens per frame pair (64 frames)
    share = 6_600 / 2 + pair
    assert b["weights_partitioned"] == a["weights_partitioned"] and b["logits"] == a["logits"]
    assert b["embeddings_in_and_out"] == pytest.approx(a["embeddings_in_and_out"] * share / 6_600)
    assert b["activations_checkpointed_layers"] == pytest.approx(a["activations_checkpointed_layers"] * share / 6_600)
    assert b["sequence_exchange"] == pytest.approx(2 * share * 8192 * 2) and a["sequence_exchange"] == 0
    assert b["vision_forward_no_grad"] < 0.6 * a["vision_forward_no_grad"]


def test_more_ranks_per_sequence_fit_more_frames_on_the_same_cards():
    frames = [largest_frames(MODEL, SAMPLE, 10_000_000, n, ZERO, limit_gib=12.0, sequence_parallel=n)
              for n in (1, 2, 4)]
    assert frames[0] < frames[1] < frames[2], frames
    assert all(f % 2 == 0 for f in frames)

"""Packed batches (train.pack_tokens, issue #20): each sample's loss in a pack equals its loss alone,
for every model family, and the comparison can fail; the packed schedule keeps the ledgers' promises.

Tolerance. Everything runs in float32 on the CPU. A pack and a sample alone do the same arithmetic
on the same values, except that matrix products and attention run over other shapes (one row of
all the samples' tokens against one sample's; the vision tower over all the videos at once), so
sums may be blocked and ordered differently: each such sum of n terms may differ by about
n x 2^-24 relative. With n <= a few hundred and a handful of layers that is ~1e-5 of a logit's
scale at most. Measured here: at most 4.8e-7 (two float32 ulps of a loss of ~5) for every family,
often exactly 0. Per-token losses (cross-entropy, ~ln 128 = 4.9) are compared within ``ATOL`` =
1e-5 absolute and ``RTOL`` = 1e-5; a leak across a boundary moved them by 4e-3 to 0.17 (``LEAK``
= 1e-3 is the least a leak must show).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3_5Config,
                          Qwen3_5ForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from videosft.kernels import attention_backends, packed_attention
from videosft.training.batches import collate, collate_pack, host_positions, prepare, tokens_in
from videosft.encoding.chat import IGNORE_INDEX
from videosft.kernels.gated_deltanet import select_gated_delta_rule
from videosft.media.pixels import stored_frames
from videosft.training.loss import supervised_loss, token_losses
from videosft.kernels.vision_attention import batch_vision_attention

ATOL = RTOL = 1e-5
LEAK = 1e-3
VOCAB, VIDEO, START, END, IMAGE = 128, 120, 121, 122, 123
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
# 4 frames -> 2 frame pairs of a (2, 4) patch grid -> 2 merged tokens per pair
FRAMES = {"qwen3_5": (32, 64), "qwen3_vl": (32, 64), "qwen2_5_vl": (28, 56)}
# (text before the video, text after it, answer tokens): three samples of different lengths, the
# middle one longer than a Gated-DeltaNet chunk of 64
LAYOUTS = [(9, 5, 4), (50, 20, 9), (20, 8, 6)]


def tiny_model(family: str, split_over: int = 2):
    """A tiny model of the family; ``split_over`` 4 gives every head count of its language model four
    (or eight) heads, so that they split over four sequence-parallel ranks."""
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    kv = max(2, split_over)
    if family == "qwen3_5":
        config = Qwen3_5Config(
            text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=kv, head_dim=32, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=kv, linear_num_value_heads=2 * kv,
                             layer_types=["linear_attention", "full_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True}),
            vision_config=dict(**vision, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                               num_position_embeddings=16), **TOKENS)
        model = Qwen3_5ForConditionalGeneration(config)
        with torch.no_grad():  # slow decay, long memory (as trained heads have): a leaked state would last
            for layer in model.model.language_model.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.A_log.fill_(-4.0)
    elif family == "qwen3_vl":
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=kv, head_dim=16,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
            vision_config=dict(**vision, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            tie_word_embeddings=False, **TOKENS)
        model = Qwen3VLForConditionalGeneration(config)
    else:
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=kv,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(**vision, patch_size=14, fullatt_block_indexes=[0]), **TOKENS)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.eval()
    select_gated_delta_rule(model, torch.device("cpu"), 128)  # Qwen3.5: the torch paths that honour boundaries
    batch_vision_attention(model)  # as the train stage runs the vision tower
    return model


def video_processor(family: str):
    if family == "qwen2_5_vl":
        return Qwen2VLVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2)
    return Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)


def sample(family: str, index: int, layout: tuple[int, int, int], pairs: int = 2) -> dict:
    """A sample as the store holds it, in the family's prompt layout: Qwen3.x put each frame pair
    after its own time marker; Qwen2.5-VL has one run of video tokens. Each frame pair is a (2, 4)
    patch grid: 2 merged tokens."""
    rng = np.random.default_rng(index)
    before, after, answer = layout
    height, width = FRAMES[family]
    frames = torch.from_numpy(rng.integers(0, 256, (2 * pairs, 3, height, width), dtype=np.uint8))
    text = lambda n: rng.integers(1, 100, n).tolist()  # noqa: E731
    if family == "qwen2_5_vl":
        video = [START] + [VIDEO] * (2 * pairs) + [END]
    else:
        video = [token for pair in range(pairs) for token in (*text(2), START, VIDEO, VIDEO, END)]
    ids = text(before) + video + text(after) + text(answer)
    labels = [IGNORE_INDEX] * (len(ids) - answer) + ids[-answer:]
    return {"window_id": f"w{index}", "input_ids": ids, "labels": labels,
            "mm_token_type_ids": [2 if t == VIDEO else 0 for t in ids], **stored_frames(frames),
            "video_grid_thw": [pairs, 2, 4], "second_per_grid": 1.0 if family == "qwen2_5_vl" else None}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl", "qwen2_5_vl"])
def family_pack(request):
    family = request.param
    model, processor = tiny_model(family), video_processor(family)
    rows = [sample(family, i, layout) for i, layout in enumerate(LAYOUTS)]
    positions = host_positions(model)
    alone = [token_losses(model, prepare([row], 0, processor, positions, pin=False)) for row in rows]
    pack = prepare(rows, 0, processor, positions, pin=False, pack=True)
    bounds = pack["cu_seq_lens_q"].tolist()
    return family, model, rows, alone, pack, bounds


def per_sample_losses(model, pack, bounds):
    return [token_losses(model, pack, start, end) for start, end in zip(bounds[:-1], bounds[1:])]


def test_each_sample_in_a_pack_has_its_loss_alone(family_pack):
    family, model, rows, alone, pack, bounds = family_pack
    assert pack["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) == (1, bounds[-1])
    assert "attention_mask" not in pack and tokens_in(pack) == bounds[-1]
    assert pack["position_ids"].shape == (4, 1, bounds[-1])
    assert pack["position_ids"][0, 0, bounds[1]] == 0  # text positions restart
    packed = per_sample_losses(model, pack, bounds)
    differences = [(p - a).abs().max().item() for p, a in zip(packed, alone)]
    print(f"{family}: largest per-token loss difference per sample, packed vs alone: {differences}")
    for got, expected in zip(packed, alone):
        assert got.shape == expected.shape and got.numel() > 0
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # the training loss of a pack: the mean over all its supervised tokens, as for a padded batch
    with torch.no_grad():
        loss = supervised_loss(model, pack)
    torch.testing.assert_close(loss, torch.cat(alone).mean(), atol=ATOL, rtol=RTOL)


def test_token_losses_are_the_whole_sequences_losses_at_a_samples_supervised_targets(family_pack):
    """token_losses asks the model for logits at the supervised positions only (a 16k-token pack's whole
    logits are 16 GiB at Qwen3.5's vocabulary): the same losses as the whole sequence's logits give."""
    family, model, rows, alone, pack, bounds = family_pack
    with torch.no_grad():
        logits = model(**{k: v for k, v in pack.items() if k != "labels"}, use_cache=False).logits[0].float()
    for start, end in zip(bounds[:-1], bounds[1:]):
        targets = pack["labels"][0, start + 1:end]
        kept = targets != IGNORE_INDEX
        expected = torch.nn.functional.cross_entropy(logits[start:end - 1][kept], targets[kept], reduction="none")
        assert kept.any()
        torch.testing.assert_close(token_losses(model, pack, start, end), expected, atol=1e-6, rtol=1e-6)


def test_without_restarting_positions_attention_crosses_the_boundary(family_pack):
    """The equality above can fail: one position row running on through the pack lets the
    full-attention layers see the samples before (no block-diagonal mask)."""
    family, model, rows, alone, pack, bounds = family_pack
    through = {**pack, "position_ids": pack["position_ids"].clone()}
    through["position_ids"][0, 0] = torch.arange(bounds[-1])
    leaked = per_sample_losses(model, through, bounds)
    torch.testing.assert_close(leaked[0], alone[0], atol=ATOL, rtol=RTOL)  # nothing before the first sample
    moved = [(got - expected).abs().max().item() for got, expected in zip(leaked[1:], alone[1:])]
    assert min(moved) > LEAK, moved


def test_without_boundaries_the_gated_deltanet_carries_state_across(family_pack):
    """Qwen3.5 only: with the attention masked per sample but no ``cu_seq_lens_q``, the linear-attention
    layers' recurrent and convolution states run from one sample into the next."""
    family, model, rows, alone, pack, bounds = family_pack
    if family != "qwen3_5":
        pytest.skip("no Gated-DeltaNet layers")
    leaked = per_sample_losses(model, {k: v for k, v in pack.items() if k != "cu_seq_lens_q"}, bounds)
    torch.testing.assert_close(leaked[0], alone[0], atol=ATOL, rtol=RTOL)
    moved = [(got - expected).abs().max().item() for got, expected in zip(leaked[1:], alone[1:])]
    assert min(moved) > LEAK, moved


def test_a_pack_is_one_row_whose_labels_never_cross_a_boundary():
    rows = [sample("qwen3_vl", i, layout) for i, layout in enumerate(LAYOUTS)]
    processor = video_processor("qwen3_vl")
    pack = collate_pack(rows, processor, lambda batch: torch.zeros(3, 1, batch["input_ids"].shape[1], dtype=torch.long))
    starts = pack["cu_seq_lens_q"].tolist()[:-1]
    assert all(pack["labels"][0, start] == IGNORE_INDEX for start in starts)
    padded = collate(rows, 0, processor)
    assert torch.equal(pack["pixel_values_videos"], padded["pixel_values_videos"])
    assert torch.equal(pack["video_grid_thw"], padded["video_grid_thw"])
    supervised = (pack["labels"] != IGNORE_INDEX).sum()
    assert supervised == (padded["labels"] != IGNORE_INDEX).sum() == sum(layout[2] for layout in LAYOUTS)


# ---------------------------------------------------------------- the packed schedule


def run_schedule(lengths, world, budget, tail, micro_steps, out, seed=0):
    """Every rank's micro-batches over ``micro_steps`` steps (ledgers written as the train stage writes
    them); resumes from a copy of the cursors halfway, as a checkpoint would."""
    import dataclasses
    import json

    from videosft.training.sampling import Cursor, packed_epoch_plan

    def plan_for(epoch):
        return packed_epoch_plan(lengths, world, budget, tail, seed, epoch)

    batches = {rank: [] for rank in range(world)}
    for rank in range(world):
        cursor, saved = Cursor(), None
        with open(out / f"ledger.rank{rank}.jsonl", "w") as ledger:
            for step in range(micro_steps):
                if step == micro_steps // 2:
                    saved = dataclasses.asdict(cursor)
                    cursor = Cursor(**json.loads(json.dumps(saved)))  # through a checkpoint's JSON
                epoch, indices = cursor.next_batch(plan_for, rank, 1)
                batches[rank].append((epoch, indices))
                for index in indices:
                    ledger.write(json.dumps({"epoch": epoch, "step": step, "index": index}) + "\n")
    return batches, plan_for


@pytest.mark.parametrize("tail", ["pad", "drop"])
def test_packs_stay_under_the_budget_every_rank_runs_as_many_and_the_ledgers_account_for_all(tmp_path, tail):
    from videosft.training.sampling import check_ledgers, packed_epoch_plan, seeded_order

    lengths = np.random.default_rng(3).integers(200, 1000, 41).tolist()
    world, budget = 3, 2000
    # a seed whose first epoch makes a pack count that does not divide into the ranks: the tail policy acts
    seed = next(s for s in range(100) if len(packed_epoch_plan(lengths, world, budget, "pad", s, 0).padded))
    plans = [packed_epoch_plan(lengths, world, budget, tail, seed, epoch) for epoch in range(3)]
    counts = [{len(packs) for packs in plan.packs} for plan in plans]
    assert all(len(c) == 1 for c in counts)  # in each epoch, the same number of micro-batches on every rank
    per_epoch = [c.pop() for c in counts]
    batches, plan_for = run_schedule(lengths, world, budget, tail, per_epoch[0] + per_epoch[1] + 1, tmp_path, seed)
    for rank, taken in batches.items():
        assert all(sum(lengths[i] for i in indices) <= budget for _, indices in taken)
        assert [epoch for epoch, _ in taken] == [0] * per_epoch[0] + [1] * per_epoch[1] + [2]
    record = check_ledgers(tmp_path, world, len(lengths), plan_for, [f"w{i}" for i in range(len(lengths))])
    assert record["finished_epochs"] == 2
    first = plans[0]
    read = sorted(i for rank in range(world) for i in first.per_rank[rank])
    assert sorted(read + first.dropped) == sorted(list(range(len(lengths))) + first.padded)
    assert record["dropped" if tail == "drop" else "padded_repeats"]
    # packs are whole samples in the seeded order: the ranks' packs, dealt back in turn, are that order
    dealt = [i for p in range(per_epoch[0]) for rank in range(world) for i in first.packs[rank][p]]
    order = seeded_order(len(lengths), seed, 0)
    assert dealt[:len(lengths) - len(first.dropped)] == order[:len(lengths) - len(first.dropped)]


def test_a_sample_longer_than_the_budget_is_named(tmp_path):
    from videosft.errors import ConfigError
    from videosft.training.sampling import check_pack_budget, packed_epoch_plan

    with pytest.raises(ConfigError, match=r"train.pack_tokens=500 .* w1 \(900 tokens\); raise train.pack_tokens to "
                                          r"at least 900"):
        check_pack_budget([100, 900, 300], ["w0", "w1", "w2"], 500)
    from videosft.training.sampling import DataError

    with pytest.raises(DataError, match="ranks? would get no batch|a rank would get no batch"):
        packed_epoch_plan([400, 400, 400], 4, 1000, "drop", 0, 0)


def test_without_packing_the_cursor_reads_the_slices_it_always_read():
    """micro_batch samples at a time from the rank's list, a new epoch when fewer are left."""
    from videosft.training.sampling import Cursor, epoch_plan

    def plan_for(epoch):
        return epoch_plan(11, 2, 2, "drop", 0, epoch)

    cursor, taken = Cursor(), []
    for _ in range(5):
        taken.append(cursor.next_batch(plan_for, 1, 2))
    # 11 samples, 2 ranks x 2: 3 dropped, 4 per rank, 2 batches per epoch
    expected = [(epoch, plan_for(epoch).per_rank[1][i:i + 2]) for epoch in (0, 1) for i in (0, 2)] + \
               [(2, plan_for(2).per_rank[1][0:2])]
    assert taken == expected and cursor == Cursor(epoch=2, position=2)


@pytest.mark.parametrize("buckets", [False, True], ids=["sdpa", "buckets"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl", "qwen2_5_vl"])
def test_the_bound_packed_attention_runs_each_sample_alone(family, buckets, monkeypatch):
    """With videosft.kernels.packed_attention bound, a pack's full-attention layers split at ``cu_seq_lens_q``
    themselves: even with positions running on through the pack (so transformers builds no
    block-diagonal mask, and the unbound model leaks, as the test above shows) every sample's
    losses are its losses alone; a sample alone runs the same causal attention, with ``buckets``
    (as on a Hopper GPU) padded to its bucket, and its losses are the unbound model's; a padded
    batch is transformers' SDPA unchanged."""
    monkeypatch.setitem(attention_backends._buckets, "on", buckets)
    padded_from = []
    bucket_length = attention_backends.bucket_length
    monkeypatch.setattr(attention_backends, "bucket_length", lambda n: padded_from.append(n) or bucket_length(n))
    model, processor, unbound = tiny_model(family), video_processor(family), tiny_model(family)
    assert packed_attention.bind(model) == "sdpa"
    assert model.config.get_text_config()._attn_implementation == packed_attention.NAME
    rows = [sample(family, i, layout) for i, layout in enumerate(LAYOUTS)]
    positions = host_positions(model)
    singles = [prepare([row], 0, processor, positions, pin=False) for row in rows]
    alone = [token_losses(model, single) for single in singles]
    for got, single in zip(alone, singles):
        torch.testing.assert_close(got, token_losses(unbound, single), atol=ATOL, rtol=RTOL)
    lengths = [len(row["input_ids"]) for row in rows]
    assert sorted(set(padded_from)) == (sorted(set(lengths)) if buckets else [])
    pack = prepare(rows, 0, processor, positions, pin=False, pack=True)
    bounds = pack["cu_seq_lens_q"].tolist()
    through = {**pack, "position_ids": pack["position_ids"].clone()}
    through["position_ids"][0, 0] = torch.arange(bounds[-1])
    for got, expected in zip(per_sample_losses(model, through, bounds), alone):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    padded = collate(rows, 0, processor)
    torch.testing.assert_close(token_losses(model, padded), token_losses(unbound, padded), atol=0, rtol=0)

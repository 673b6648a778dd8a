"""Sequence parallelism (train.sequence_parallel) is exact: a sequence split over n ranks gives every
supervised token the loss it has on one rank, and every LoRA tensor the gradient it has there, for
each family, packed and unpacked, n = 2 (two groups: 2 data-parallel x 2 sequence-parallel) and n = 4,
in one world of 4 gloo ranks (tests/training/sequence_parallel_worker.py). And the check can fail:
a target, a position or a pack boundary off by one moves the losses, a cut one token into a frame
pair is refused.

Tolerance. float32 on the CPU; the split changes only the shapes of the matrix products (a slice's
tokens, a share of the heads) and so the blocking of their sums: measured per-token loss differences
0 to 4.8e-7 (two ulps of a loss of ~5) and LoRA gradients within 1.5e-6 of their largest element.
Losses are held to ``LOSS_ATOL`` = 1e-5 and gradients to ``GRAD_RTOL`` = 1e-4 of the tensor's largest
element; the off-by-ones moved the losses by 3e-4 to 0.39 (``MOVED`` = 1e-4, 200 times the largest
exact difference, is the least they must).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from videosft.training.sequence_shards import cut_points, frame_pairs, local_videos, split_sequence

WORKER = Path(__file__).with_name("sequence_parallel_worker.py")
LOSS_ATOL, GRAD_RTOL, MOVED = 1e-5, 1e-4, 1e-4
FAMILIES = ("qwen3_5", "qwen3_vl", "qwen2_5_vl")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sequence-parallel")
    cases = [{"family": family, "packed": packed} for family in FAMILIES for packed in (False, True)]
    mutated = [{**case, "mutations": ["targets", "positions", "bounds", "cut"]} for case in cases]
    runs = [{"n": 2, "cases": mutated}, {"n": 4, "cases": cases}]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                           str(WORKER), json.dumps({"runs": runs}), str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [case for rank in json.loads((out / "result.json").read_text()) for case in rank]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_loss_and_lora_gradient_equals_one_ranks(results, family, packed, n):
    mine = [r for r in results if (r["family"], r["packed"], r["n"]) == (family, packed, n)]
    assert len(mine) == 4  # every rank reported
    for rank in mine:
        assert rank["tokens"] > 0 and rank["loss_difference"] <= LOSS_ATOL, rank
        assert rank["grad_relative_difference"] <= GRAD_RTOL, rank
        assert rank["nonzero_grads"] == rank["lora_tensors"] > 0  # every LoRA tensor was compared, none vacuously
        assert all(len(lengths) == n and min(lengths) > 0 for lengths in rank["lengths"])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_an_off_by_one_moves_the_losses_or_is_refused(results, family):
    for rank in [r for r in results if r["family"] == family and r["n"] == 2]:
        mutations = rank["mutations"]
        assert mutations["targets"] > MOVED and mutations["positions"] > MOVED, mutations
        if rank["packed"]:
            assert mutations["bounds"] > MOVED, mutations
        assert "Video features and video tokens do not match" in mutations["cut"], mutations


def test_cuts_fall_at_frame_pairs_near_equal_shares_and_every_rank_gets_a_pair():
    # text 0-9, four pairs of 2 video tokens each behind 2 text tokens, answer after
    types = [0] * 10 + [0, 0, 2, 2] * 4 + [0] * 6
    pairs = frame_pairs(types, [[4, 2, 4]], merge=2)
    assert pairs == [(12, 14), (16, 18), (20, 22), (24, 26)]
    assert cut_points(len(types), pairs, 2) == [0, 16, 32]
    assert cut_points(len(types), pairs, 4) == [0, 16, 20, 24, 32]  # one pair each, however uneven
    with pytest.raises(ValueError, match="4 frame pairs cannot give each of 8 ranks a pair"):
        cut_points(len(types), pairs, 8)
    split = split_sequence(types, [[4, 2, 4]], 2, 2)
    assert split.lengths == (16, 16) and split.pair_cuts == (0, 1, 4)


def test_one_run_of_video_tokens_holds_several_pairs_and_a_mismatch_is_named():
    types = [0, 0] + [2] * 8 + [0]  # Qwen2.5-VL: one run for the whole video
    assert frame_pairs(types, [[4, 2, 4]], 2) == [(2, 4), (4, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="fewer video tokens"):
        frame_pairs(types, [[5, 2, 4]], 2)
    with pytest.raises(ValueError, match="beyond the grids"):
        frame_pairs(types, [[3, 2, 4]], 2)
    # two videos of a pack: a rank holding pairs 2-4 holds the first video's last pair and two of the second's
    assert local_videos([[3, 2, 4], [4, 2, 4]], 2, 5) == [(0, 2, [1, 2, 4]), (1, 0, [2, 2, 4])]


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_each_rank_decodes_only_its_own_frames_and_gets_the_same_pixels_on_host_or_device(packed, monkeypatch):
    """A rank of a group decodes only the frames of its own frame pairs (at 512 frames, n times less host
    work than decoding the sample and cutting the pixels); whether the processor then runs on the host
    thread (CPU) or where the batch goes (GPU), the rank gets the same pixels, grids and tokens."""
    import torch

    from sequence_parallel_worker import LAYOUTS, PAIRS, sample, video_processor
    from videosft.media.pixels import EncodedFrames
    from videosft.training.batches import BatchesAhead
    from videosft.training.sequence_shards import SequenceGroup

    decoded = []
    decode = EncodedFrames.decode
    monkeypatch.setattr(EncodedFrames, "decode", lambda frames: decoded.append(len(frames)) or decode(frames))
    rows = [sample("qwen3_vl", i, layout) for i, layout in enumerate(LAYOUTS[:3])]

    def positions(batch):  # what is cut, not what it holds, is under test here
        return torch.arange(batch["input_ids"].shape[1]).expand(3, 1, -1)

    wanted = [0, 1, 2] if packed else [1]
    for place in range(3):
        made = {}
        for on_device in (False, True):
            decoded.clear()
            batches = BatchesAhead(lambda indices: [rows[i] for i in indices], 0, video_processor("qwen3_vl"),
                                   torch.device("cpu"), positions, pack=packed, pixels_on_device=on_device,
                                   shard=SequenceGroup(group=None, place=place, n=3, merge=2).shard)
            made[on_device] = batches.take(wanted)
            batches.close()
            assert sum(decoded) == 2 * int(made[on_device]["video_grid_thw"][:, 0].sum())  # 2 frames a pair
            assert sum(decoded) < 2 * PAIRS * len(wanted)  # not the whole sample's
        assert made[True]["sequence"] == made[False]["sequence"]
        tensors = [key for key, value in made[False].items() if torch.is_tensor(value)]
        assert set(tensors) == {key for key, value in made[True].items() if torch.is_tensor(value)}
        assert all(torch.equal(made[True][key], made[False][key]) for key in tensors)
        assert made[False]["pixel_values_videos"].shape[0] == 8 * int(made[False]["video_grid_thw"][:, 0].sum())


def test_a_size_the_model_or_world_cannot_take_is_refused_naming_the_numbers():
    from types import SimpleNamespace

    from videosft.errors import ConfigError
    from videosft.training.sequence_shards import check_sequence_parallel

    text = SimpleNamespace(num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32,
                           linear_num_key_heads=16)
    check_sequence_parallel(4, 8, text, 1)
    with pytest.raises(ConfigError) as refused:
        check_sequence_parallel(8, 12, text, 2)
    message = str(refused.value)
    assert "train.sequence_parallel: 8 cannot be used" in message
    assert "the world of 12 ranks is not a whole number of groups of 8" in message
    assert "4 key/value heads do not split over 8 ranks" in message and "micro_batch_size is 2" in message
    assert "16 attention heads" not in message.split(". Choose")[0]  # 16 splits over 8: not a problem

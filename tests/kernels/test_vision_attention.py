"""The vision tower's attention batched over equal frame pairs computes what the per-pair loop does."""

from __future__ import annotations

import pytest
import torch

from videosft.kernels.vision_attention import batch_vision_attention, equal_chunk_length


@pytest.fixture(scope="module")
def tiny_model(demo_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(demo_dir / "model", dtype=torch.float32)
    return model.eval()


def vision_output(model, grids):
    visual = model.model.visual
    patch = visual.config.in_channels * visual.config.temporal_patch_size * visual.config.patch_size**2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = visual(pixels, grid_thw=torch.tensor(grids))
    return output.pooler_output if hasattr(output, "pooler_output") else output


@pytest.mark.parametrize("grids", [[[4, 4, 6]], [[3, 4, 4], [2, 6, 4]], [[2, 4, 4], [1, 2, 2]]])
def test_batched_attention_matches_the_per_pair_loop(tiny_model, grids):
    expected = vision_output(tiny_model, grids)
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    assert batch_vision_attention(tiny_model) == tiny_model.config.vision_config.depth
    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        got = vision_output(tiny_model, grids)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    pairs = sum(t for t, _, _ in grids)
    equal = len({h * w for _, h, w in grids}) == 1
    depth = tiny_model.config.vision_config.depth
    if equal:  # one call per layer over every pair
        assert [shape[0] for shape in calls] == [pairs] * depth
    else:  # transformers' own loop: one call per pair and layer
        assert len(calls) == pairs * depth and all(shape[0] == 1 for shape in calls)


def test_chunk_lengths_are_read_once_per_tensor():
    cu = torch.tensor([0, 4, 8, 12])
    assert equal_chunk_length(cu) == 4
    cu[3] = 13  # changed in place: the cached answer stands for the same tensor object...
    assert equal_chunk_length(cu) == 4
    assert equal_chunk_length(torch.tensor([0, 4, 9])) is None  # ...a new tensor is read afresh

"""Reading a flat element range of a checkpoint tensor touches only its rows and returns exactly
those elements (each ZeRO-3 rank loads its partition this way)."""

from __future__ import annotations

import random

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from videosft.models.checkpoint import read_elements


def test_element_ranges_equal_the_flattened_tensor(tmp_path):
    tensors = {"matrix": torch.randn(37, 11), "cube": torch.randn(5, 6, 7), "vector": torch.randn(29),
               "scalar": torch.tensor(3.0), "bf16": torch.randn(13, 9).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "t.safetensors")
    rng = random.Random(0)
    with safe_open(tmp_path / "t.safetensors", framework="pt") as handle:
        for key, tensor in tensors.items():
            flat = tensor.reshape(-1)
            for _ in range(200):
                start = rng.randrange(0, flat.numel() + 3)
                stop = rng.randrange(0, flat.numel() + 3)
                got = read_elements(handle, key, start, min(stop, flat.numel()))
                assert got.dtype == tensor.dtype and torch.equal(got, flat[start:min(stop, flat.numel())]), (key, start, stop)

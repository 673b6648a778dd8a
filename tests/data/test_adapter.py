"""An adapter directory that cannot be read is refused before a base model is loaded for it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from videosft.data.adapter import ADAPTER_WEIGHTS, check_readable
from videosft.errors import InputError


def test_a_whole_adapter_passes_and_one_cut_short_or_missing_is_named(tmp_path):
    weights = tmp_path / ADAPTER_WEIGHTS
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(4, 16)}, weights)
    check_readable(tmp_path)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 20])  # a copy stopped short
    with pytest.raises(InputError, match=f"{weights}: not a readable safetensors file .*forcerun train"):
        check_readable(tmp_path)
    weights.unlink()
    with pytest.raises(InputError, match=f"no {ADAPTER_WEIGHTS}"):
        check_readable(tmp_path)

"""One rank trains without ZeRO (train.zero3_on_one_rank: false, the default): the model built whole and
DeepSpeed at stage 0, since ZeRO-3 would partition nothing there. It trains the adapter ZeRO-3 on one rank
trains, and its checkpoint holds only what trains and resumes to the same adapter bit for bit.

Not bit for bit against ZeRO-3: ZeRO-3 sums the gradients into its flat fp32 partition and steps a copy of
the adapters there, in another order of the same sums, so the adapters differ in the last bits; a gradient
lost, doubled or clipped differently would show at the size of the tensor itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_torchrun
from test_train_policies import record_of, train_args, with_train

pytestmark = pytest.mark.slow  # three one-rank runs


def grad_norms(out) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (out / "steps.rank0.jsonl").read_text().splitlines()]


def test_one_rank_trains_without_zero_what_zero3_trains_and_resumes_exactly(prepared, demo_config, tmp_path):
    manifest = prepared / "preprocess" / "manifest.json"
    cfg = with_train(demo_config, steps=4, save_every=2, grad_clip=0.05)  # the clip acts on every step
    whole, zero3, resumed = tmp_path / "whole", tmp_path / "zero3", tmp_path / "resumed"
    shown = run_torchrun(train_args(cfg, manifest, prepared, whole), nproc=1)
    assert "one rank: the model is built whole and DeepSpeed runs without ZeRO" in shown.stdout
    run_torchrun(train_args(with_train(cfg, zero3_on_one_rank=True), manifest, prepared, zero3), nproc=1)
    ours, theirs = record_of(whole)["results"], record_of(zero3)["results"]
    assert (ours["zero_stage"], theirs["zero_stage"]) == (0, 3)
    assert ours["zero3_leaf_blocks"] == [] and theirs["zero3_leaf_blocks"]
    assert ours["losses_rank0"] == pytest.approx(theirs["losses_rank0"], rel=1e-6)
    norms = grad_norms(whole)
    assert min(norms) > 0.05 and norms == pytest.approx(grad_norms(zero3), rel=1e-5)  # before clipping, as ZeRO-3's
    adapter, reference = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (whole, zero3))
    assert adapter.keys() == reference.keys() and adapter
    for key, tensor in reference.items():
        scale = tensor.abs().max().item()
        assert scale > 0 and (tensor - adapter[key]).abs().max().item() <= 1e-4 * scale, key

    # DeepSpeed's checkpoint without ZeRO keeps the adapters and their optimizer state, not the frozen model
    saved = torch.load(whole / "checkpoints" / "step-2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert saved["module"] and all("lora_" in key for key in saved["module"])
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "adapter")
    run_torchrun(train_args(cfg, manifest, prepared, resumed, "--resume"), nproc=1)
    again = record_of(resumed)["results"]
    assert again["resumed_from_step"] == 2 and again["losses_rank0"] == ours["losses_rank0"]
    continued = load_file(resumed / "adapter" / "adapter_model.safetensors")
    assert continued.keys() == adapter.keys() and all(continued[key].equal(adapter[key]) for key in adapter)

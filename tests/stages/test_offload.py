"""train.offload_activations: the inputs gradient checkpointing keeps go through host memory, and
nothing else changes (same loss, same gradients)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.autograd.graph import saved_tensors_hooks

from conftest import PROJECT, run_torchrun, stage_json
from videosft.training.setup import enable_checkpointing

pytestmark = pytest.mark.slow  # trains on 2 ranks


def loss_and_saved_states(model_dir, offload: bool):
    """Loss, parameter gradients, and how many hidden-state-sized tensors the graph keeps itself."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    enable_checkpointing(model, offload=offload, pin_memory=False)
    text = model.config.get_text_config()
    input_ids = torch.randint(0, text.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    kept = []

    def pack(tensor):  # outermost hooks: see what the model saves that no inner hook took
        if tensor.dim() == 3 and tensor.shape[1:] == (96, text.hidden_size):
            kept.append(tuple(tensor.shape))
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), gradients, len(kept), text.num_hidden_layers


def test_checkpointed_inputs_go_to_the_host_and_gradients_do_not_change(demo_dir):
    loss, gradients, kept, layers = loss_and_saved_states(demo_dir / "model", offload=False)
    offloaded_loss, offloaded_gradients, offloaded_kept, _ = loss_and_saved_states(demo_dir / "model", offload=True)
    assert kept >= layers  # without offload the graph holds each layer's input itself
    assert offloaded_kept == kept - layers  # with it, every layer input went through the host hooks
    assert offloaded_loss == loss
    assert gradients.keys() == offloaded_gradients.keys() and len(gradients) > 0
    for name, gradient in gradients.items():
        assert torch.equal(gradient, offloaded_gradients[name]), name


def test_offload_profile_trains_the_same_adapter_on_two_ranks(prepared, demo_config, tmp_path):
    """zero3_offload.json (weights' partition in host memory) with offloaded checkpoint inputs gives
    the adapter the default profile gives, bit for bit; the plan counts neither on the device."""
    adapters, plans = {}, {}
    for name, train in {"default": {}, "offload": {"deepspeed_config": str(PROJECT / "workflow" / "deepspeed" /
                                                                           "zero3_offload.json"),
                                                   "offload_activations": True}}.items():
        cfg = {**demo_config, "train": {**demo_config["train"], "steps": 2, **train}}
        out = tmp_path / name
        run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples",
                      str(prepared / "preprocess" / "manifest.json"), "--probe",
                      str(prepared / "probe" / "probe.json"), "--out", str(out)])
        assert (out / "adapter" / "adapter_model.safetensors").exists()
        adapters[name] = load_file(out / "adapter" / "adapter_model.safetensors")
        plans[name] = json.loads((out / "run_record.json").read_text())["results"]["memory"]["predicted"]
    assert adapters["default"].keys() == adapters["offload"].keys()
    for key, tensor in adapters["default"].items():
        assert torch.equal(tensor, adapters["offload"][key]), key
    assert plans["offload"]["components_gib"]["weights_partitioned"] == 0
    assert plans["default"]["components_gib"]["weights_partitioned"] > 0
    assert (plans["offload"]["components_gib"]["activations_checkpointed_layers"]
            < plans["default"]["components_gib"]["activations_checkpointed_layers"])

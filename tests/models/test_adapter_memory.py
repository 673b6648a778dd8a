"""What LoRA's adapters keep for the backward pass, as the memory plan counts it (training.memory.adapter_bytes),
against what peft really keeps: each adapted projection's input copied to the fp32 adapters' dtype."""

from __future__ import annotations

import json

import torch
from peft import LoraConfig, get_peft_model
from torch.autograd.graph import saved_tensors_hooks

from conftest import PROJECT
from videosft.kernels.fused import build_meta_model
from videosft.models.lora import adapted_inputs
from videosft.training.memory import CALIBRATED_LORA_TARGETS, adapter_bytes

QWEN35_4B = PROJECT / "bench" / "configs" / "Qwen3.5-4B.json"


def test_the_published_qwen35_4b_layers_read_these_values_into_their_adapters():
    model = build_meta_model(QWEN35_4B)
    every = adapted_inputs(model, ["all-linear"])
    fitted = adapted_inputs(model, list(CALIBRATED_LORA_TARGETS))
    kinds = model.config.get_text_config().layer_types
    assert len(every) == len(fitted) == len(kinds) == 32
    for layer, kind in enumerate(kinds):
        if kind == "linear_attention":  # in_proj_qkv, _z, _b, _a and gate, up from 2,560; out 4,096; down 9,216
            assert (every[layer], fitted[layer]) == (6 * 2560 + 4096 + 9216, 0), layer
        else:  # q, k, v, gate, up from 2,560; o 4,096; down 9,216; the calibration's q and v
            assert (every[layer], fitted[layer]) == (5 * 2560 + 4096 + 9216, 2 * 2560), layer


def kept_bytes_per_layer(model, tokens: int) -> list[int]:
    """Bytes each decoder layer's forward saves for the backward pass (parameters left out), one bf16 forward."""
    layers = model.base_model.model.model.layers
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, kept = [None], [dict() for _ in layers]
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, index=index: current.__setitem__(0, index))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in parameters:
            kept[current[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    embeddings = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs_embeds=embeddings)
    return [sum(layer.values()) for layer in kept]


def test_peft_keeps_what_the_plan_counts_for_its_fp32_adapters_in_a_bf16_model():
    """Qwen3.5-4B's widths, two layers (Gated-DeltaNet, full attention), bf16 with peft's fp32 adapters and no
    dropout (dropout's mask is a float tensor on the CPU, one byte on CUDA): what every linear layer's adapters
    keep beyond q_proj / v_proj's is the plan's figure, give or take lora_B's r-wide inputs."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = json.loads(QWEN35_4B.read_text())["text_config"]
    text = {**text, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "vocab_size": 256}
    config = Qwen3_5TextConfig(**{key: value for key, value in text.items() if key != "model_type"})
    tokens, rank = 64, 8
    kept = {}
    for targets in (["all-linear"], list(CALIBRATED_LORA_TARGETS)):
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
        names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                 and name != "lm_head" and (targets == ["all-linear"] or name.rsplit(".", 1)[-1] in targets)]
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, target_modules=names))
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        kept[targets[0]] = kept_bytes_per_layer(model, tokens)
    every, fitted = kept["all-linear"], kept["q_proj"]
    inputs = {"all-linear": [6 * 2560 + 4096 + 9216, 5 * 2560 + 4096 + 9216], "fitted": [0, 2 * 2560]}
    for layer in range(2):
        planned = tokens * (adapter_bytes(inputs["all-linear"][layer], "bf16", 0.0)
                            - adapter_bytes(inputs["fitted"][layer], "bf16", 0.0))
        lora_b_inputs = tokens * rank * 4 * 8  # at most eight adapted projections a layer, r fp32 values a token
        assert planned <= every[layer] - fitted[layer] <= planned + lora_b_inputs, layer

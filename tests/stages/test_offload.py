"""train.offload_activations: the inputs gradient checkpointing keeps go through host memory, and
nothing else changes (same loss, same gradients). The two-rank run under the offload profile is
held to the golden run's adapter in tests/stages/test_train_verify.py."""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from videosft.training.setup import enable_checkpointing


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

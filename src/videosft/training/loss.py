"""The training loss: cross-entropy at the supervised positions only, and per-token losses to compare."""

from __future__ import annotations

from ..encoding.chat import IGNORE_INDEX
from .sampling import DataError


def supervised_loss(model, batch: dict):
    """Cross-entropy over the supervised positions only: the LM head never sees the rest.

    The mean over every supervised token of the micro-batch: each token weighs the same, in a padded
    batch as in a pack (``train.pack_tokens``), so a pack's loss is that of its samples as a padded
    batch, and a sample's tokens count as they would there."""
    import torch

    labels = batch["labels"]
    targets = labels[:, 1:]
    positions = torch.nonzero((targets != IGNORE_INDEX).any(dim=0)).flatten()
    if positions.numel() == 0:
        raise DataError("a batch has no supervised token")
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs, logits_to_keep=positions, use_cache=False).logits
    chosen = targets[:, positions]
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), chosen.reshape(-1), ignore_index=IGNORE_INDEX
    )


def token_losses(model, batch: dict, start: int = 0, end: int | None = None):
    """Per-token cross-entropy, without gradients, at the supervised targets among tokens [start, end) of
    the batch's first row: a packed sample's losses, to hold against the same sample's alone. Logits only
    at those positions, as in training: a whole pack's would be tokens x vocabulary floats (16 GiB for
    16k tokens of Qwen3.5's 248k)."""
    import torch

    labels = batch["labels"][0]
    end = end or labels.shape[0]
    targets = labels[start + 1:end]
    chosen = torch.nonzero(targets != IGNORE_INDEX).flatten()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, logits_to_keep=chosen + start,
                       use_cache=False).logits[0].float()
    return torch.nn.functional.cross_entropy(logits, targets[chosen], reduction="none")

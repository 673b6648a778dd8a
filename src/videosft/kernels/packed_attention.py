"""The language model's full-attention layers over a pack (``train.pack_tokens``): one causal SDPA
per sample instead of one SDPA over the whole pack under a block-diagonal mask.

From a pack's restarting positions transformers builds a (tokens x tokens) boolean mask, and SDPA
with an explicit mask cannot take its flash kernel: on an H200 a pack of 16k tokens then trained
slower per token than the same samples padded (bench/RESULTS.md). A pack's samples never attend to
each other, so each sample's causal attention alone is the same arithmetic, and
``is_causal=True`` without a mask lets SDPA pick its fastest kernel.

:func:`bind` registers :data:`NAME` with transformers' attention and mask interfaces and sets it
on the language model only (the vision tower keeps its own). Without ``cu_seq_lens_q`` in a call
(no pack: a padded batch, generation) it is transformers' SDPA unchanged, mask included; with it,
the mask transformers built is ignored and each sample runs alone, which is exactly what that mask
allows. The mask interface is transformers' SDPA one, so a pack still gets its block-diagonal mask
wherever this function is not bound.
"""

from __future__ import annotations

NAME = "videosft_packed_sdpa"


def packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                **kwargs):
    """transformers' SDPA attention, or with ``cu_seq_lens_q`` (a pack of one row) one causal SDPA per
    sample; query, key and value are (batch, heads, tokens, head size), the output (batch, tokens,
    heads, head size) as transformers' attention functions return it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from .attention_backends import causal_sdpa

    bounds = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    if bounds is None and query.shape[0] == 1 and attention_mask is None and _causal(module, query, key, is_causal):
        return causal_sdpa(module, query, key, value, dropout, scaling), None
    if bounds is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return per_sample(module, query, key, value, _edges(bounds), dropout, scaling), None


def per_sample(module, query, key, value, edges: list[int], dropout: float, scaling):
    """Each sample's causal attention alone (``edges``: where each starts, then the end), concatenated:
    output (batch, tokens, heads, size)."""
    import torch

    from .attention_backends import causal_sdpa

    return torch.cat([causal_sdpa(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], dropout,
                                  scaling) for start, end in zip(edges[:-1], edges[1:])], dim=1)


def _causal(module, query, key, is_causal) -> bool:
    """Whether transformers' SDPA would run this call causally on itself (a whole sequence, no cache)."""
    wanted = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(wanted) and query.shape[2] > 1 and query.shape[2] == key.shape[2]


_last: list = [None, None]  # the pack's boundaries tensor and its values on the host


def _edges(bounds) -> list[int]:
    """The boundaries as host integers, read once per pack rather than once per layer (each read
    waits for the device). The tensor itself is kept, so a later pack's cannot take its place."""
    if _last[0] is not bounds:
        _last[:] = [bounds, [int(edge) for edge in bounds.tolist()]]
    return _last[1]


def bind(model) -> str:
    """Run the language model's full-attention layers with :func:`packed_sdpa`; returns what they ran before."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config()
    before = text._attn_implementation
    if before != "sdpa":
        return before  # flash attention takes cu_seq_lens itself; eager keeps the block-diagonal mask
    text._attn_implementation = NAME
    return before

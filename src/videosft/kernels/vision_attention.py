"""The vision tower's attention in one call per layer instead of one per frame pair.

Qwen's vision towers attend within each frame pair only (``cu_seqlens`` marks where each pair's
patches start). Without flash-attention's variable-length kernel, transformers splits the sequence
at those marks and calls SDPA once per pair and layer: at 128 frames on Qwen3.5-4B that is 64
pairs x 24 layers = 1,536 small calls per step, each a few microseconds of GPU work behind tens of
microseconds of host work, plus one device-to-host copy of the lengths per layer.

A video's frame pairs all have the same grid, hence the same length. Then the split is a reshape:
one SDPA call over a batch of pairs computes the same attention (same kernel, same scaling, each
pair attending to itself only). :func:`batch_vision_attention` makes each vision attention module
do that when every chunk has the same length and SDPA is the attention implementation, and keep
transformers' own forward otherwise (images of several sizes, Qwen2.5-VL's uneven windows, flash
attention). :func:`bind` also gives the batched forward the rotary embedding in one kernel
(:mod:`videosft.kernels.vision_rotary`) once :func:`videosft.kernels.vision_rotary.select` has checked it.
"""

from __future__ import annotations

import functools
import sys
import types

from .vision_rotary import rotary, select as select_rotary

# the cu_seqlens tensor last seen and its chunk length: all layers of one forward share the tensor,
# so its lengths cross to the host once per forward rather than once per layer
_last_lengths: list = [None, None]


def equal_chunk_length(cu_seqlens) -> int | None:
    """The common length of every chunk, or None when they differ."""
    if _last_lengths[0] is cu_seqlens:
        return _last_lengths[1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    length = lengths[0] if lengths and all(n == lengths[0] for n in lengths) else None
    _last_lengths[:] = [cu_seqlens, length]
    return length


def _batched_forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    import torch.nn.functional as F

    length = equal_chunk_length(cu_seqlens) if self.config._attn_implementation == "sdpa" else None
    if length is None:
        return self._unbatched_forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
    seq_length = hidden_states.shape[0]
    query, key, value = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    query, key = self._rotary(query, key, cos, sin)
    chunks = seq_length // length

    def by_chunk(tensor):  # (sequence, heads, dim) -> (chunks, heads, length, dim)
        return tensor.reshape(chunks, length, self.num_heads, -1).transpose(1, 2)

    dropout = self.attention_dropout if self.training else 0.0
    output = F.scaled_dot_product_attention(by_chunk(query), by_chunk(key), by_chunk(value), dropout_p=dropout,
                                            scale=self.scaling, is_causal=False)
    return self.proj(output.transpose(1, 2).reshape(seq_length, -1))


def vision_attention_modules(model) -> list[tuple]:
    """The vision attention modules of ``model`` that the batched forward can take, each with its modeling
    module's ``apply_rotary_pos_emb_vision``."""
    found = []
    for module in model.modules():
        modeling = sys.modules[type(module).__module__]
        if (type(module).__name__.endswith("VisionAttention") and hasattr(modeling, "apply_rotary_pos_emb_vision")
                and all(hasattr(module, name) for name in ("qkv", "proj", "num_heads", "scaling", "config"))):
            found.append((module, modeling.apply_rotary_pos_emb_vision))
    return found


def batch_vision_attention(model, fused_rotary: bool = False, modules: list[tuple] | None = None) -> int:
    """Give every vision attention module of ``model`` (``modules``: :func:`vision_attention_modules`'s, where
    already found) the batched forward, with the fused rotary embedding where ``fused_rotary`` or transformers'
    function; returns how many modules."""
    modules = vision_attention_modules(model) if modules is None else modules
    for module, reference in modules:
        if not hasattr(module, "_unbatched_forward"):
            module._unbatched_forward = module.forward
            module.forward = types.MethodType(_batched_forward, module)
        module._rotary = functools.partial(rotary, reference=reference) if fused_rotary else reference
    return len(modules)


def bind(model, device, requested: str = "auto") -> tuple[dict, int]:
    """The batched forward on every vision attention module, its rotary embedding in one kernel once
    :func:`videosft.kernels.vision_rotary.select` has found it equal to transformers' (``requested``: the fused
    kernels' choice); returns that selection's record and how many modules were batched."""
    modules = vision_attention_modules(model)
    chosen = select_rotary(modules, device, requested)
    return chosen, batch_vision_attention(model, chosen["implementation"] == "triton", modules)

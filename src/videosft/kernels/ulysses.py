"""Sequence parallelism inside the language model (Ulysses): each rank of a sequence-parallel group
holds a contiguous slice of one sequence, and its attention runs on every token for a share of the
heads.

Before a layer's sequence mixing, an all-to-all trades each rank's slice of all heads for the whole
sequence of its own heads; after it, the inverse all-to-all trades back. Everything else of a decoder
layer (projections, norms, MLP, the LoRA products) is per token and runs on the slice as it is.

* Full attention (every family): :func:`ulysses_sdpa`, registered as an attention implementation
  of the language model. The rotary embedding is applied per token before it, from the positions of
  the whole sequence sliced. The whole sequence's attention is causal, or causal per sample of a
  pack (its boundaries from the shard, not from the slice's own positions).
* Qwen3.5's Gated-DeltaNet: :func:`gated_deltanet_forward` replaces the layer's forward. The
  projections run on the slice; the query, key and value channels, the gates and betas cross to
  head shards; the short causal convolution is per channel, so it runs on the whole sequence of the
  rank's heads with their own filter rows; the chunked delta rule (transformers' or fla's, as
  bound) runs there with the pack's boundaries; the output crosses back before the gated norm.

Why by hand: DeepSpeed's ``DistributedAttention`` exchanges equal slices of a (sequence, batch,
heads, size) layout for one attention call; here the slices are unequal (a rank's slice ends at a
frame-pair boundary, so that its frames are its own for the vision tower) and the Gated-DeltaNet
layer needs the exchange around its convolution and delta rule, with per-head parameters sliced.
fla's context-parallel path splits the sequence, not the heads, for its chunked kernels; it does not
cover transformers' torch fallback that CPU runs use. The exchange itself is
``torch.distributed.nn.functional.all_to_all_single`` with uneven splits, which is differentiable:
the backward of one exchange is the inverse exchange.

The shard in flight (:class:`Shard`: the group, every rank's slice length, the pack's boundaries over
the whole sequence) is set around each forward and backward by :func:`sharding` and read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

NAME = "videosft_ulysses_sdpa"


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's part of a sequence split over a sequence-parallel group."""
    group: object  # the torch.distributed process group of the ranks that share the sequence
    rank: int  # this rank's place in the group
    lengths: tuple[int, ...]  # every rank's slice length, in group order (the slices are contiguous)
    bounds: tuple[int, ...] | None = None  # a pack's sample boundaries over the whole sequence

    @property
    def size(self) -> int:
        return len(self.lengths)


_current: list[Shard | None] = [None]


@contextlib.contextmanager
def sharding(shard: Shard):
    """The shard the layers exchange for, around one micro-batch's forward and backward."""
    _current[0] = shard
    try:
        yield shard
    finally:
        _current[0] = None


def current() -> Shard | None:
    return _current[0]


def to_heads(x, shard: Shard):
    """(batch, heads, slice tokens, size) -> (batch, heads / n, all tokens, size): this rank's heads
    of the whole sequence, the slices in group order."""
    import torch
    from torch.distributed.nn.functional import all_to_all_single

    batch, heads, length, size = x.shape
    share = heads // shard.size
    send = x.reshape(batch, shard.size, share, length, size).transpose(0, 1).contiguous().reshape(-1)
    unit = batch * share * size
    received = torch.empty(unit * sum(shard.lengths), dtype=x.dtype, device=x.device)
    received = all_to_all_single(received, send, [unit * n for n in shard.lengths], [unit * length] * shard.size,
                                 group=shard.group)
    pieces = received.split([unit * n for n in shard.lengths])
    return torch.cat([piece.reshape(batch, share, n, size) for piece, n in zip(pieces, shard.lengths)], dim=2)


def to_sequence(y, shard: Shard):
    """The inverse of :func:`to_heads`: (batch, heads / n, all tokens, size) -> (batch, heads, slice tokens, size)."""
    import torch
    from torch.distributed.nn.functional import all_to_all_single

    batch, share, _, size = y.shape
    mine = shard.lengths[shard.rank]
    send = torch.cat([piece.reshape(-1) for piece in y.split(list(shard.lengths), dim=2)])
    unit = batch * share * size
    received = torch.empty(unit * mine * shard.size, dtype=y.dtype, device=y.device)
    received = all_to_all_single(received, send, [unit * mine] * shard.size, [unit * n for n in shard.lengths],
                                 group=shard.group)
    return received.reshape(shard.size, batch, share, mine, size).transpose(0, 1).reshape(batch, share * shard.size,
                                                                                            mine, size)


def _causal_sdpa(module, query, key, value, bounds, dropout: float, scaling):
    """Causal attention over the whole sequence, or per sample of a pack; output (batch, tokens, heads, size)."""
    from .attention_backends import causal_sdpa
    from .packed_attention import per_sample

    if bounds is None:
        return causal_sdpa(module, query, key, value, dropout, scaling)
    return per_sample(module, query, key, value, list(bounds), dropout, scaling)


def ulysses_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    """transformers' attention interface: query, key and value (batch, heads, slice tokens, size) of this
    rank's slice; the output (batch, slice tokens, heads, size). Without a shard in flight (verify,
    generation, a run without sequence parallelism) the packed-aware SDPA it replaced."""
    from .packed_attention import packed_sdpa

    shard = current()
    if shard is None:
        return packed_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                           is_causal=is_causal, **kwargs)
    whole = _causal_sdpa(module, to_heads(query, shard), to_heads(key, shard), to_heads(value, shard), shard.bounds,
                         dropout, scaling)
    return to_sequence(whole.transpose(1, 2), shard).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """The mask interface for :data:`NAME`: the attention builds its own causal structure for the whole
    sequence, so no (slice x slice) mask is made."""
    return None


def _head_rows(start: int, width: int, shard: Shard) -> slice:
    share = width // shard.size
    return slice(start + shard.rank * share, start + (shard.rank + 1) * share)


def gated_deltanet_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A Qwen3.5 Gated-DeltaNet layer's forward on this rank's slice (see the module docstring); the
    layer's own forward when no shard is in flight."""
    import torch
    import torch.nn.functional as F

    shard = current()
    if shard is None or cache is not None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    modeling = sys.modules[type(self).__module__]
    batch, length, _ = hidden_states.shape
    kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    bounds = None if shard.bounds is None else torch.tensor(shard.bounds, dtype=torch.long,
                                                              device=hidden_states.device)
    query, key, value = self.in_proj_qkv(hidden_states).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    z = self.in_proj_z(hidden_states).reshape(batch, length, -1, self.head_v_dim)

    def heads(x, count):  # (batch, slice, count * size) -> (batch, count / n, all tokens, size)
        return to_heads(x.reshape(batch, length, count, -1).transpose(1, 2), shard)

    q, k, v = heads(query, self.num_k_heads), heads(key, self.num_k_heads), heads(value, self.num_v_heads)
    b, a = heads(self.in_proj_b(hidden_states), self.num_v_heads), heads(self.in_proj_a(hidden_states),
                                                                        self.num_v_heads)
    total = q.shape[2]
    # the short convolution over the whole sequence of this rank's channels, with their own filter rows
    mixed = torch.cat([x.transpose(1, 2).reshape(batch, total, -1) for x in (q, k, v)], dim=-1).transpose(1, 2)
    weight = self.conv1d.weight.squeeze(1)
    rows = [_head_rows(0, self.key_dim, shard), _head_rows(self.key_dim, self.key_dim, shard),
            _head_rows(2 * self.key_dim, self.value_dim, shard)]
    weight = torch.cat([weight[r] for r in rows])
    bias = None if self.conv1d.bias is None else torch.cat([self.conv1d.bias[r] for r in rows])
    conv_kwargs = {} if bounds is None else {"cu_seq_lens_q": bounds}
    mixed = modeling.causal_conv1d_fn(mixed, weight, bias, activation=self.activation, **conv_kwargs).transpose(1, 2)
    local_key, local_value = self.key_dim // shard.size, self.value_dim // shard.size
    query, key, value = mixed.split([local_key, local_key, local_value], dim=-1)
    query = query.reshape(batch, total, -1, self.head_k_dim)
    key = key.reshape(batch, total, -1, self.head_k_dim)
    value = value.reshape(batch, total, -1, self.head_v_dim)
    gate_heads = _head_rows(0, self.num_v_heads, shard)
    beta = b.squeeze(-1).transpose(1, 2).sigmoid()
    g = -self.A_log[gate_heads].float().exp() * F.softplus(a.squeeze(-1).transpose(1, 2).float()
                                                            + self.dt_bias[gate_heads])
    core, _ = modeling.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                                    output_final_state=False, use_qk_l2norm_in_kernel=True,
                                                    cu_seqlens=bounds)
    core = to_sequence(core.transpose(1, 2), shard).transpose(1, 2)  # (batch, slice, value heads, size)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, length, -1))


def bind(model) -> dict:
    """Make the language model's sequence mixing exchange for a shard in flight: full attention through
    :func:`ulysses_sdpa` (when it runs SDPA, as the train stage's models do), every Gated-DeltaNet layer
    through :func:`gated_deltanet_forward`. Outside :func:`sharding` both compute as before."""
    import types

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ulysses_sdpa)
    AttentionMaskInterface.register(NAME, _no_mask)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config()
    if text._attn_implementation not in ("sdpa", "videosft_packed_sdpa"):
        raise ValueError(f"sequence parallelism runs the language model's attention as SDPA; it is set to "
                         f"{text._attn_implementation!r}")
    text._attn_implementation = NAME
    linear = [m for m in base.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    for layer in linear:
        layer.forward = types.MethodType(gated_deltanet_forward, layer)
    return {"attention": NAME, "gated_deltanet_layers": len(linear)}

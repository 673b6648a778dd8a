"""Which of PyTorch's SDPA kernels training uses, and the language model's causal attention on cuDNN's.

On a Hopper GPU cuDNN's SDPA kernel is the fastest PyTorch has for the language model's causal
attention (Qwen3.5's head size 256 most of all): at 128 frames on one H200, 2.2 ms forward and 8.6 ms
backward per layer against 4.8 and 14.3 ms for the flash kernel, 92 ms of a 1.28 s step
(bench/RESULTS.md, the 128-frame regression). But cuDNN builds an execution plan for every new
shape, forward and backward, 60-90 ms of host time each, during which the device waits; with
samples of varying length (every real dataset) nearly every step would bring new shapes.

So :func:`causal_sdpa` pads each causal attention's sequence up to a *bucket*
(:func:`bucket_length`: a multiple of 1/16 of its power of two, at least 256 tokens), and cuDNN's
plans are made once per bucket, not per length. The padding is exact: under the causal mask a
real position never attends to a later (padded) one, and in the backward pass a padded query's
output gradient is zero, so it adds nothing to any real key's or value's gradient. It costs at most
1/16 more rows (3% on average) and a copy of query, key and value.

Elsewhere cuDNN's kernel stays off while training on micro-batches without padding: the vision
tower's batched attention (:mod:`videosft.kernels.vision_attention`) changes shape with the frame
count and gains 0.2 ms a layer. Padded micro-batches (``micro_batch_size`` > 1 without
``pack_tokens``) keep PyTorch's choice: their attention carries a padding mask, which the flash
kernel does not take, and cuDNN's masked kernel outran the memory-efficient one by more than its
plans cost (one H200: 7,108 tokens/s with cuDNN off against 8,434 with it, in different runs).
On a GPU before Hopper nothing is padded: cuDNN's kernel was not measured faster there.
"""

from __future__ import annotations

import functools

MIN_BUCKET = 256
# whether causal_sdpa pads to buckets and asks for cuDNN's kernel first (for_batches sets it)
_buckets = {"on": False}


def bucket_length(tokens: int) -> int:
    """The padded length for ``tokens``: up to a multiple of max(256, its power of two / 16)."""
    step = max(MIN_BUCKET, 1 << max(0, tokens.bit_length() - 5))
    return -(-tokens // step) * step


def for_batches(device, padded: bool) -> dict:
    """Turn cuDNN's SDPA kernel off on a CUDA device (process-wide) unless micro-batches are ``padded``,
    and bucket the causal attention onto it on a Hopper or later GPU; which kernels SDPA may use now."""
    import torch

    _buckets["on"] = False
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(padded)
        _buckets["on"] = (not padded and torch.cuda.is_available() and torch.backends.cudnn.is_available()
                          and torch.cuda.get_device_capability(device) >= (9, 0))
    backends = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}
    return {"sdpa_backends": sorted(name for name, enabled in backends.items() if enabled),
            "causal_attention": "cuDNN, padded to buckets" if _buckets["on"] else "SDPA's choice"}


def causal_sdpa(module, query, key, value, dropout: float, scaling, buckets: bool | None = None):
    """Causal attention of query, key and value (batch, heads, tokens, size) on themselves, no mask; the
    output (batch, tokens, heads, size), as transformers' attention functions return it. With
    ``buckets`` (default: what :func:`for_batches` chose) the sequence is padded to
    :func:`bucket_length` and cuDNN's kernel is asked for first."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not (_buckets["on"] if buckets is None else buckets):
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens = query.shape[2]
    extra = bucket_length(tokens) - tokens
    if extra:
        query, key, value = (F.pad(tensor, (0, 0, 0, extra)) for tensor in (query, key, value))
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    # torch before 2.6 takes no priority; its own order puts cuDNN's kernel first on Hopper anyway
    chosen = sdpa_kernel(order, set_priority=True) if _takes_priority() else sdpa_kernel(order)
    with chosen:
        output = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                        is_causal=True)[0]
    return output[:, :tokens]


@functools.cache  # asked once, not in every layer's attention of every step
def _takes_priority() -> bool:
    import inspect

    from torch.nn.attention import sdpa_kernel

    return "set_priority" in inspect.signature(sdpa_kernel).parameters

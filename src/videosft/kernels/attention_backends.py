"""Which of PyTorch's SDPA kernels training may use: none that builds a plan per sequence length.

On a Hopper GPU, PyTorch's scaled-dot-product attention prefers cuDNN's kernel. cuDNN builds an
execution plan for every new shape, forward and backward, and caches it by shape: 60-90 ms of host
time each on an H200 (``bench/packing.py --profile``), during which the device waits. With samples
of varying length (every real dataset) nearly every step brings new shapes, in the language model's
full-attention layers and in the vision tower, so the plans cost a step more than the attention
itself does. The flash and memory-efficient kernels need no plan, so cuDNN's stays off while training
on micro-batches without padding (one sample, or a pack: causal attention, no mask).

Padded micro-batches (``micro_batch_size`` > 1 without ``pack_tokens``) keep PyTorch's choice: their
attention carries a padding mask, which the flash kernel does not take, and cuDNN's masked kernel
outran the memory-efficient one by more than its plans cost (one H200: 7,108 tokens/s with cuDNN
off against 8,434 with it, in different runs).
"""

from __future__ import annotations


def for_batches(device, padded: bool) -> dict:
    """Turn cuDNN's SDPA kernel off on a CUDA device (process-wide) unless micro-batches are ``padded``;
    which kernels SDPA may use now."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(padded)
    backends = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}
    return {"sdpa_backends": sorted(name for name, enabled in backends.items() if enabled)}

"""The vision tower's rotary position embedding in one kernel, bit for bit transformers' result.

transformers' ``apply_rotary_pos_emb_vision`` (Qwen2.5-VL, Qwen3-VL, Qwen3.5) casts q and k to fp32,
builds ``rotate_half`` by slicing, negating and concatenating, multiplies twice, adds and casts back:
fourteen kernels per layer, each a pass over the tower's whole sequence. On a profiled Qwen3.5-4B
step (bench/RESULTS.md) that was 1.81 ms of a 4.68 ms vision block, more than the block's matrix
products, about 5% of the step. :func:`rotary` does it in one Triton program per token that reads q and
k where the attention's ``qkv`` output holds them (strided views, no copy) and writes both results.

Same bits, not merely close: the kernel computes each product and the sum in fp32 with separate
roundings, as transformers' separate kernels do (Triton's contraction of ``a * b + c`` into one fused
multiply-add is turned off, ``enable_fp_fusion=False``), and rounds the fp32 sum to q's dtype to
nearest even, as PyTorch's cast does. :func:`select` checks that on the device at the tower's head
shapes before anything is bound, all ranks agreeing; one differing element is a
:class:`~videosft.kernels.checks.KernelCheckError` naming the shape and the switch, never a silent
fallback. Where a gradient is needed (a LoRA adapter on the tower) or the tensors are laid out
otherwise, :func:`rotary` calls transformers' function. ``VIDEOSFT_FUSED_KERNELS=torch`` (the fused
kernels' switch, :data:`videosft.kernels.fused.ENV`) keeps transformers' function throughout.

    python bench/vision_rotary.py --model-config bench/configs/Qwen3.5-4B.json   # check and time on a GPU
"""

from __future__ import annotations

import os

from .checks import CHECK_SHORT_TOKENS, KernelCheckError, all_ranks_agree, requested_choice
from .fused import ENV

# An odd length with a partial wave of programs, and a tower's sequence of a few frames.
CHECK_TOKENS = (CHECK_SHORT_TOKENS, 4096)
DTYPES = ("float32", "float16", "bfloat16")
MAX_BLOCK = 1 << 14  # elements of one program's (heads x half dim) tile
_KERNEL = None


def _kernel():
    """The Triton kernel, built on first use: importing Triton costs a CPU run seconds for nothing."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    # q and k are written out in full rather than through a shared helper: Triton cannot call a jit
    # function made here, inside the builder, and one at module level would import Triton with the module.
    @triton.jit
    def rotary_kernel(q, k, cos, sin, q_out, k_out, q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                      trig_stride, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        in_dims = dims < HALF
        mask = (heads < HEADS) & in_dims
        trig = token * trig_stride + dims
        cos1 = tl.load(cos + trig, mask=in_dims).to(tl.float32)
        cos2 = tl.load(cos + trig + HALF, mask=in_dims).to(tl.float32)
        sin1 = tl.load(sin + trig, mask=in_dims).to(tl.float32)
        sin2 = tl.load(sin + trig + HALF, mask=in_dims).to(tl.float32)
        out = token * (HEADS * 2 * HALF) + heads * (2 * HALF) + dims
        # transformers: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        at = q + token * q_token_stride + heads * q_head_stride + dims
        x1 = tl.load(at, mask=mask).to(tl.float32)
        x2 = tl.load(at + HALF, mask=mask).to(tl.float32)
        tl.store(q_out + out, (x1 * cos1 + (-x2) * sin1).to(q_out.dtype.element_ty), mask=mask)
        tl.store(q_out + out + HALF, (x2 * cos2 + x1 * sin2).to(q_out.dtype.element_ty), mask=mask)
        at = k + token * k_token_stride + heads * k_head_stride + dims
        x1 = tl.load(at, mask=mask).to(tl.float32)
        x2 = tl.load(at + HALF, mask=mask).to(tl.float32)
        tl.store(k_out + out, (x1 * cos1 + (-x2) * sin1).to(k_out.dtype.element_ty), mask=mask)
        tl.store(k_out + out + HALF, (x2 * cos2 + x1 * sin2).to(k_out.dtype.element_ty), mask=mask)

    _KERNEL = rotary_kernel
    return _KERNEL


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _blocks(heads: int, half: int) -> tuple[int, int]:
    return 1 << max(heads - 1, 0).bit_length(), 1 << max(half - 1, 0).bit_length()


def fits(q, k, cos, sin) -> bool:
    """Whether the kernel takes these tensors: q and k of one shape (tokens, heads, head dim) and dtype,
    the last dimension contiguous and even, cos and sin (tokens, head dim) alike, on a CUDA device (or on
    any under Triton's interpreter, for the tests)."""
    if q.dim() != 3 or k.shape != q.shape or k.dtype != q.dtype or str(q.dtype).removeprefix("torch.") not in DTYPES:
        return False
    tokens, heads, head_dim = q.shape
    if head_dim % 2 or tokens == 0 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        return False
    if not (q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1 and cos.stride() == sin.stride()):
        return False
    if not (cos.dtype.is_floating_point and sin.dtype == cos.dtype):
        return False
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1 or (q.device.type != "cuda" and not _interpreting()):
        return False
    block_h, block_d = _blocks(heads, head_dim // 2)
    return block_h * block_d <= MAX_BLOCK


def rotary(q, k, cos, sin, reference):
    """transformers' ``apply_rotary_pos_emb_vision(q, k, cos, sin)`` (``reference``), in one kernel where
    :func:`fits` and no gradient is needed; ``reference`` itself otherwise."""
    import torch

    if (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))) or not fits(q, k, cos, sin):
        return reference(q, k, cos, sin)
    tokens, heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    block_h, block_d = _blocks(heads, head_dim // 2)
    options = {} if _interpreting() else {"enable_fp_fusion": False}
    _kernel()[(tokens,)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), HEADS=heads, HALF=head_dim // 2, BLOCK_H=block_h, BLOCK_D=block_d,
                         num_warps=4, **options)
    return q_out, k_out


def check_inputs(tokens: int, heads: int, head_dim: int, dtype, device, seed: int = 0):
    """q and k as the tower's attention makes them (strided views of one ``qkv`` output) and fp32 cos and
    sin of random angles, from a seeded generator."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    query, key, _ = qkv.permute(1, 0, 2, 3).unbind(0)
    angles = torch.rand(tokens, (head_dim + 1) // 2, generator=generator) * 100
    angles = torch.cat([angles, angles], dim=-1)[:, :head_dim].to(device)  # both halves alike, as the tower's
    return query, key, angles.cos(), angles.sin()


def differing_elements(tokens: int, heads: int, head_dim: int, dtype, device, reference) -> int:
    """How many output elements of q and k the kernel computes differently from ``reference``."""
    inputs = check_inputs(tokens, heads, head_dim, dtype, device)
    got, expected = rotary(*inputs, reference=reference), reference(*inputs)
    return sum(int((a != b).sum()) for a, b in zip(got, expected))


def head_shapes(modules) -> list[tuple[int, int]]:
    """The distinct (heads, head dim) of the vision attention modules (``(module, reference)`` pairs)."""
    shapes = set()
    for module, _ in modules:
        heads = module.num_heads
        shapes.add((heads, getattr(module, "head_dim", None) or module.config.hidden_size // heads))
    return sorted(shapes)


def tower_dtype(modules):
    """The dtype the tower's attention computes in (its ``qkv`` weight's, partitioned or not), else bf16."""
    import torch

    weight = getattr(getattr(modules[0][0], "qkv", None), "weight", None)
    return weight.dtype if weight is not None else torch.bfloat16


def select(modules, device, requested: str = "auto", dtype=None, lengths=CHECK_TOKENS) -> dict:
    """Whether the tower's attention modules (``(module, reference)`` pairs, the reference being their
    modeling module's ``apply_rotary_pos_emb_vision``) take :func:`rotary`: checked bit for bit at their
    head shapes on ``device`` in ``dtype`` (default: the tower's, :func:`tower_dtype`) and in fp32, at ``lengths``
    tokens, every rank agreeing.
    ``requested`` as the fused kernels' (``auto``, ``fla`` or ``torch``; :data:`ENV` overrides it):
    ``torch`` keeps transformers' function, the others the kernel wherever a CUDA device is."""
    import torch

    requested, _ = requested_choice(requested, ENV)
    device = torch.device(device)
    record = {"requested": requested, "modules": len(modules), "implementation": "torch", "checks": []}
    if not modules:
        record.update(implementation=None, reason="no vision attention with transformers' rotary function")
        return record
    if requested == "torch":
        record["reason"] = "asked for"
        return record
    if device.type != "cuda" and not _interpreting():
        record["reason"] = "no CUDA device"
        return record
    dtypes = sorted({dtype or tower_dtype(modules), torch.float32}, key=str)
    failures = []
    for heads, head_dim in head_shapes(modules):
        for check_dtype in dtypes:
            for tokens in lengths:
                differing = differing_elements(tokens, heads, head_dim, check_dtype, device, modules[0][1])
                row = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "dtype": str(check_dtype),
                       "differing_elements": differing}
                record["checks"].append(row)
                if differing:
                    failures.append(row)
    if not all_ranks_agree(not failures, device):
        where = "; ".join(f"{r['differing_elements']} of {2 * r['tokens'] * r['heads'] * r['head_dim']} elements "
                          f"at {r['tokens']} tokens x {r['heads']} heads x {r['head_dim']} in {r['dtype']}"
                          for r in failures) or "on another rank"
        raise KernelCheckError(f"the fused vision rotary embedding differs from transformers' "
                               f"apply_rotary_pos_emb_vision: {where}. Set {ENV}=torch to run transformers' "
                               f"kernels, and report the shapes")
    record["implementation"] = "triton"
    return record

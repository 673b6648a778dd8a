"""fla's RMSNorm kernels, launched so that a new sequence length compiles nothing new.

fla 0.6.0's ``layer_norm_fwd`` and ``layer_norm_bwd`` pass two values derived from the number of rows
as Triton compile-time constants (``tl.constexpr``): the forward's ``NB = cdiv(rows, 2048)`` (an
autotune key the kernel body never reads) and the backward's rows per program
``BS = cdiv(rows, SMs)``. Triton compiles a kernel for each distinct constant. Samples of varying
length, which every real dataset has (windows of different durations, queries of different
lengths), then compile three new backward kernels at nearly every step: the hidden-state norm and
the query and key head norms, 0.2-0.8 s each, while the device waits. On one H200 that was 1.2 s of a
2.5 s step (``bench/packing.py --profile``), and a packed run, whose every pack has its own length,
paid it at every step.

Here both constants are rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, ... (the powers of two
and 1.5 times them), so lengths share kernels: about 2 log2(rows) of them over all lengths. The
backward then runs ``cdiv(rows, BS)`` programs: at least two thirds as many as fla gives rows to.
The kernels and their arithmetic are fla's own, unchanged: only how many rows each program takes
differs, and every row is still normalised alone. :mod:`videosft.kernels.fused` checks these functions
against the torch forward before binding them, like every fused kernel.
"""

from __future__ import annotations

import math

ROWS_PER_NB = 2048  # fla's forward: NB = cdiv(rows, 2048)
ROW_KERNEL_ABOVE = 512  # fla: feature sizes above this use the one-row-per-program kernels


def rounded_up(value: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^(k-1)) that is >= value."""
    if value <= 2:
        return max(1, value)
    power = 1 << (value - 1).bit_length()  # smallest power of two >= value
    return power * 3 // 4 if power * 3 // 4 >= value else power


def forward_blocks(rows: int) -> int:
    """The forward's ``NB`` (its autotune key) for ``rows`` rows."""
    return rounded_up(math.ceil(rows / ROWS_PER_NB))


def backward_split(rows: int, programs: int) -> tuple[int, int]:
    """(rows per program ``BS``, programs ``NS``) of the backward, for at most ``programs`` programs."""
    per_program = rounded_up(math.ceil(rows / max(1, min(programs, rows))))
    return per_program, math.ceil(rows / per_program)


def _block_width(x, width: int) -> int:
    import triton

    block = min(65536 // x.element_size(), triton.next_power_of_2(width))
    if width > block:
        raise RuntimeError(f"RMSNorm over {width} features is more than fla's kernels take")
    return block


def _forward(x, weight, eps: float):
    """y = x / rms(x) * weight and the per-row reciprocal rms; x is [rows, width], contiguous."""
    import torch
    from fla.modules.norm.layernorm import layer_norm_fwd_kernel, layer_norm_fwd_kernel_row

    rows, width = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    flags = dict(IS_RMS_NORM=True, HAS_RESIDUAL=False, STORE_RESIDUAL_OUT=False, HAS_WEIGHT=True, HAS_BIAS=False)
    tensors = dict(x=x, y=y, w=weight, b=None, res=None, res_out=None, mean=None, rstd=rstd, eps=eps)
    block = _block_width(x, width)
    if width <= ROW_KERNEL_ABOVE:
        layer_norm_fwd_kernel[lambda meta: (math.ceil(rows / meta["BT"]),)](
            **tensors, T=rows, G=1, D=width, BD=block, NB=forward_blocks(rows), **flags)
    else:
        layer_norm_fwd_kernel_row[(rows,)](**tensors, G=1, D=width, BD=block, **flags)
    return y, rstd


def _backward(dy, x, weight, rstd):
    """(dx, dweight) for the forward above."""
    import torch
    from fla.modules.norm.layernorm import layer_norm_bwd_kernel, layer_norm_bwd_kernel_row
    from fla.utils import get_multiprocessor_count

    rows, width = x.shape
    per_program, programs = backward_split(rows, get_multiprocessor_count(x.device.index))
    dx = torch.empty_like(x)
    dw = torch.empty((programs, width), dtype=torch.float32, device=x.device)
    arguments = dict(x=x, w=weight, b=None, y=None, dy=dy, dx=dx, dw=dw, db=None, dres=None, dres_in=None, mean=None,
                     rstd=rstd, T=rows, G=1, D=width, BS=per_program, BD=_block_width(x, width), GS=programs,
                     IS_RMS_NORM=True, HAS_DRESIDUAL=False, STORE_DRESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False)
    if width <= ROW_KERNEL_ABOVE:
        layer_norm_bwd_kernel[(programs,)](**arguments, NB=forward_blocks(rows))
    else:
        layer_norm_bwd_kernel_row[(programs,)](**arguments)
    return dx, dw.sum(0).to(weight.dtype)


def _function():
    import torch

    class ShapeStableRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            shape = x.shape
            rows = x.reshape(-1, shape[-1]).contiguous()
            with torch.cuda.device(x.device):
                y, rstd = _forward(rows, weight.contiguous(), eps)
            ctx.save_for_backward(rows, weight, rstd)
            return y.reshape(shape)

        @staticmethod
        def backward(ctx, dy):
            rows, weight, rstd = ctx.saved_tensors
            with torch.cuda.device(rows.device):
                dx, dweight = _backward(dy.reshape(rows.shape).contiguous(), rows, weight.contiguous(), rstd)
            return dx.reshape(dy.shape), dweight, None

    return ShapeStableRMSNorm


_FUNCTION = None


def rms_norm(x, weight, bias=None, residual=None, eps: float = 1e-5, prenorm: bool = False,
             residual_in_fp32: bool = False):
    """``fla.modules.norm.layernorm.rms_norm``'s signature and result (weight required, no bias or residual)."""
    global _FUNCTION
    if bias is not None or residual is not None or prenorm or residual_in_fp32 or weight is None:
        raise NotImplementedError("only the weighted RMSNorm without bias or residual is used here")
    if _FUNCTION is None:
        _FUNCTION = _function()
    return _FUNCTION.apply(x, weight, eps)

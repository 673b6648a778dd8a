"""The harness that checks a kernel against transformers' torch implementation before a run uses it.

:mod:`videosft.kernels.gated_deltanet` (the Gated-DeltaNet's chunked rule) and
:mod:`videosft.kernels.fused` (norms, SwiGLU, the causal convolution) build their own inputs and run
their own forwards; what they share is here: the choices a run may ask for and which one it gets,
the error bound and how a comparison passes, the lengths checked, the ranks agreeing on the verdict,
whether fla imports, the timing of the standalone checks and their command line.
"""

from __future__ import annotations

import contextlib
import os

from ..errors import ConfigError, UserError

CHOICES = ("auto", "fla", "torch")
# Relative error ||x - reference|| / ||reference|| allowed for the output and each input gradient:
# a few bf16 roundings (bf16 keeps 8 significant bits, unit roundoff 2^-9 = 0.002). The bug behind
# fla #640 / #984 shows as errors of 2e-2 to 0.5.
RELATIVE_ERROR_BOUND = 1e-2
CHECK_MAX_TOKENS = 8192
# The short length checked. 201 = 3 * 64 + 9: three full 64-token chunks and a partial one, for the
# chunked Gated-DeltaNet rule and fla's chunked convolution. And odd, so a norm's rows (tokens x
# heads) fill their last tile of 16 to 128 rows only where the tile divides the heads count, never
# for the norms with one row per token; an even length such as 200 fills a 16-row tile at any even
# heads count.
CHECK_SHORT_TOKENS = 201


class KernelCheckError(UserError, RuntimeError):
    """A kernel disagreed with the reference implementation."""


# ---------------------------------------------------------------- which implementation


def requested_choice(requested: str, env: str) -> tuple[str, bool]:
    """The implementation asked for, and whether the environment variable ``env`` asked (it overrides
    ``requested`` where set); a value outside :data:`CHOICES` is an error naming where it came from."""
    from_env = os.environ.get(env)
    chosen = from_env or requested
    if chosen not in CHOICES:
        source = f"{env}={chosen!r}" if from_env else f"requested={chosen!r}"
        raise ConfigError(f"{source}: choose one of {', '.join(CHOICES)}")
    return chosen, bool(from_env)


def torch_reason(requested: str, status: dict, device, asked_by: str) -> str | None:
    """Why the run takes the torch implementation, or None where fla runs (``status``: from
    :func:`fla_import_status`). An error where fla was asked for (``asked_by`` says how) and cannot run."""
    if requested in ("auto", "fla") and status["importable"] and device.type == "cuda":
        return None
    if requested == "fla":
        raise KernelCheckError(f"{asked_by} but fla cannot run here: "
                               f"{status.get('error') or f'device {device} is not a CUDA device'}")
    if requested == "torch":
        return "asked for"
    return "fla does not import" if not status["importable"] else "no CUDA device"


def fla_import_status(modules: tuple[str, ...]) -> dict:
    """Whether fla and ``modules`` of it import (Triton included), and the versions."""
    import importlib

    try:
        fla = importlib.import_module("fla")
        for name in modules:
            importlib.import_module(name)
    except Exception as error:  # missing, or its Triton does not import
        return {"importable": False, "error": f"{type(error).__name__}: {error}"}
    import triton

    return {"importable": True, "version": getattr(fla, "__version__", None), "triton": triton.__version__}


# ---------------------------------------------------------------- the comparison


def check_lengths(longest_tokens: int) -> list[int]:
    """The run's longest sequence (capped at ``CHECK_MAX_TOKENS``) and ``CHECK_SHORT_TOKENS``, neither
    longer than the run's longest."""
    return sorted({min(longest_tokens, CHECK_MAX_TOKENS), min(longest_tokens, CHECK_SHORT_TOKENS)}, reverse=True)


@contextlib.contextmanager
def exact_fp32():
    """TF32 off, so the fp32 reference is fp32 (cuDNN convolutions default to TF32)."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def relative_errors(candidate: dict, reference: dict) -> dict[str, float]:
    """||candidate - reference|| / ||reference|| per tensor (fp32, whole tensor)."""
    errors = {}
    for name, ref in reference.items():
        diff = (candidate[name].to(ref.device) - ref).norm().item()
        scale = ref.norm().item()
        errors[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return errors


def verdict(errors: dict[str, float], bound: float = RELATIVE_ERROR_BOUND) -> dict:
    """A check row's judgement: it passes when every tensor's relative error is within ``bound``."""
    worst = max(errors.values())
    return {"relative_errors": errors, "max_relative_error": worst, "bound": bound, "passed": bool(worst <= bound)}


def all_ranks_agree(ok: bool, device) -> bool:
    """True only if ``ok`` on every rank, so that all fail together and none waits on a rank that raised."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([1 if ok else 0], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ---------------------------------------------------------------- standalone checks (benchmarks)


def milliseconds_per_call(call, device, repeats: int = 3) -> float:
    """Milliseconds per ``call()`` after one untimed call (Triton compiles and autotunes there): CUDA
    events on a GPU, the wall clock elsewhere."""
    import time

    import torch

    call()
    if torch.device(device).type != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - started) * 1000 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def check_parser(description: str, time_help: str):
    """The command line of both standalone checks."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", type=Path, required=True, help="a model's config.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[CHECK_MAX_TOKENS, CHECK_SHORT_TOKENS])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--time", action="store_true", help=time_help)
    return parser

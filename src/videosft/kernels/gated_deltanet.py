"""Which Gated-DeltaNet implementation the train stage runs, checked against the reference first.

Qwen3.5's linear-attention layers call ``torch_chunk_gated_delta_rule`` in transformers' modeling
module. When flash-linear-attention (``fla``) imports, transformers binds that name to fla's
Triton kernel ``chunk_gated_delta_rule``; otherwise to its own pure-torch implementation, which
is exact (fp32 inside) but slow. This module makes the choice explicit and checked:

* ``VIDEOSFT_GATED_DELTANET`` = ``auto`` (default), ``fla`` or ``torch`` says what is wanted;
  ``auto`` takes fla on a CUDA device when it imports, else torch.
* fla 0.6.0 refuses its gated backward pass (``chunk_bwd_dqkwg``) on Hopper with Triton
  >= 3.4, < 3.7.1 (fla issue #640: wrong ``dk`` / ``dbeta`` / ``dg`` at some shapes). Where that
  guard would fire, :func:`bypass_hopper_guard` turns it off in fla's ``chunk_o`` module only, and
  the kernel is used only if :func:`check_gated_delta_rule` finds its output and every input
  gradient within :data:`videosft.kernels.checks.RELATIVE_ERROR_BOUND` of transformers' torch
  implementation (run in fp32) at every layer shape of the model, at the lengths of
  :func:`videosft.kernels.checks.check_lengths`: the longest sequence of the run (capped) and a short
  one with a partial last chunk. Triton compiles these kernels per head count and head size, not
  per length, so other lengths run the same code.
* A failed check is an error on every rank (never a silent fallback); the message names the
  switch to train with the torch implementation instead.
* The chosen function is bound to the modeling module's ``torch_chunk_gated_delta_rule`` name, so
  what runs is what the run record says, whatever transformers picked at import.

Only the chunked form is switched: training never takes the recurrent (single-token, cached) path.
The causal 1-D convolution before it, and the norms around it, are :mod:`videosft.kernels.fused`'s;
both modules check their kernels with :mod:`videosft.kernels.checks`.

Packed sequences (``train.pack_tokens``): the layer passes the boundaries it was given
(``cu_seq_lens_q``) to the chunked rule as ``cu_seqlens`` and, in its keyword arguments, to the
causal convolution. transformers' torch functions take them and ignore them, so each sample's
recurrent state and its first three convolution taps would carry the sample before it (the bug of
ms-swift PR 9865 and lmms-engine PR 167). Here the torch rule and the torch convolution run once
per sample when boundaries are given (:func:`per_sample`): the same computation as the sample
alone. fla's kernels take ``cu_seqlens`` themselves.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import time

from ..errors import ConfigError
from ..kernels.checks import (CHOICES, RELATIVE_ERROR_BOUND, KernelCheckError, all_ranks_agree, check_lengths,
                              check_parser, fla_import_status, milliseconds_per_call, relative_errors, torch_reason,
                              verdict)
from ..models.families import family_of
from ..stage_logs import WARNING_START

ENV = "VIDEOSFT_GATED_DELTANET"
NAME = "torch_chunk_gated_delta_rule"  # the name the modeling modules call
# The convolution the layer calls before it, with its keyword arguments (so packed boundaries reach
# it): wrapped here to run per sample, replaced by videosft.kernels.fused's kernel.
CONV_NAME = "causal_conv1d_fn"


# ---------------------------------------------------------------- implementations


def torch_reference(function):
    """transformers' own torch function under whatever wrappers were put around it."""
    return inspect.unwrap(function)


def per_sample(function, cu_seqlens, dim: int, *tensors):
    """``function`` on each packed sample's slice of ``tensors`` (along ``dim``), outputs joined again."""
    import torch

    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != tensors[0].shape[dim]:
        raise ValueError(f"packed sequence boundaries {bounds} do not cover the {tensors[0].shape[dim]} tokens")
    pieces = [function(*(t.narrow(dim, start, end - start) for t in tensors))
              for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, dim=dim)


def torch_implementation(reference):
    """The torch path; packed samples run one by one, each from a zero state."""

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
        def run(q, k, v, g_, b):
            return reference(q, k, v, g_, b, chunk_size=chunk_size, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

        if cu_seqlens is None:
            return run(query, key, value, g, beta)
        if initial_state is not None or output_final_state or query.shape[0] != 1:
            raise ValueError("packed sequences are for training: one row, no recurrent state in or out")
        return per_sample(lambda *parts: run(*parts)[0], cu_seqlens, 1, query, key, value, g, beta), None

    torch_chunk_gated_delta_rule.implementation = "torch"
    torch_chunk_gated_delta_rule.__wrapped__ = reference  # so torch_reference() finds it again
    return torch_chunk_gated_delta_rule


def fla_implementation(reference):
    """fla's chunked kernel behind the torch function's signature (``reference``: the torch one it replaces)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fla_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                   **kwargs):
        if chunk_size != 64:
            raise ValueError(f"fla's chunk_gated_delta_rule uses chunks of 64, asked for {chunk_size}")
        return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    fla_chunk_gated_delta_rule.implementation = "fla"
    fla_chunk_gated_delta_rule.__wrapped__ = reference
    return fla_chunk_gated_delta_rule


def packed_convolution(convolution):
    """transformers' causal convolution (``hidden [B, D, T]``), once per sample when the layer's
    keyword arguments carry packed boundaries (``cu_seq_lens_q``): each sample starts from zeros."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if cu_seqlens is None:
            return convolution(hidden_states, weight, bias, activation=activation, **kwargs)
        return per_sample(lambda x: convolution(x, weight, bias, activation=activation, **kwargs), cu_seqlens, 2,
                          hidden_states)

    causal_conv1d_fn.packed = True
    causal_conv1d_fn.__wrapped__ = inspect.unwrap(convolution)
    return causal_conv1d_fn


def bind_packed_convolution(modeling) -> None:
    """Bind :func:`packed_convolution` around the modeling module's convolution, once."""
    current = getattr(modeling, CONV_NAME, None)
    if current is not None and not getattr(current, "packed", False):
        setattr(modeling, CONV_NAME, packed_convolution(current))


def fla_status() -> dict:
    """Whether fla's Gated-DeltaNet imports, the versions, and whether its Hopper guard would refuse the backward."""
    status = fla_import_status(("fla.ops.common.chunk_o", "fla.ops.gated_delta_rule"))
    if status["importable"]:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
        status["hopper_guard_fires"] = bool(
            getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
            and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))
    return status


def bypass_hopper_guard() -> bool:
    """Turn off fla's #640 guard in ``fla.ops.common.chunk_o`` (only there); True if it was on.

    The guard reads the module globals ``IS_NVIDIA_HOPPER``, ``TRITON_ABOVE_3_4_0`` and
    ``TRITON_ABOVE_3_7_1`` when called; ``TRITON_ABOVE_3_7_1`` is used by nothing else in that module.
    Use the kernel only after :func:`check_gated_delta_rule` passed.
    """
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    if not fla_status()["hopper_guard_fires"]:
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return True


# ---------------------------------------------------------------- the check


def layer_shapes(model) -> dict[tuple, object]:
    """Distinct Gated-DeltaNet shapes (key heads, value heads, key dim, value dim) -> modeling module."""
    shapes = {}
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            shape = (module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
            shapes[shape] = sys.modules[type(module).__module__]
    return shapes


def check_inputs(shape: tuple, tokens: int, gate: str, device, seed: int = 0) -> dict:
    """Random inputs as the layer makes them: bf16 q/k/v/beta (q, k normalised in the kernel), fp32 log decay.

    ``gate`` "init": -exp(A_log) * softplus(a + dt_bias) with A in U(0.01, 16) as Qwen3.5 initialises
    it (fast decay); "slow": log-sigmoid gates divided by 16 (slow decay, long memory).
    """
    import torch

    heads_k, heads_v, dim_k, dim_v = shape
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator)

    if gate == "init":
        a_log = torch.empty(heads_v).uniform_(0.01, 16, generator=generator).log()
        g = -a_log.exp() * torch.nn.functional.softplus(randn(1, tokens, heads_v) + 1.0)
    elif gate == "slow":
        g = torch.nn.functional.logsigmoid(torch.rand(1, tokens, heads_v, generator=generator)) / 16
    else:
        raise ValueError(f"unknown gate regime {gate!r}")
    bf16 = torch.bfloat16
    return {"query": randn(1, tokens, heads_k, dim_k).to(bf16), "key": randn(1, tokens, heads_k, dim_k).to(bf16),
            "value": randn(1, tokens, heads_v, dim_v).to(bf16), "g": g.float(),
            "beta": randn(1, tokens, heads_v).sigmoid().to(bf16), "grad_out": randn(1, tokens, heads_v, dim_v).to(bf16),
            "device": device}


def _run(function, inputs: dict, upcast: bool) -> dict:
    """Output and gradients of every input (in fp32 throughout when ``upcast``)."""
    import torch

    device = inputs["device"]
    names = ("query", "key", "value", "g", "beta")
    leaves = {n: inputs[n].detach().to(device, torch.float32 if upcast else inputs[n].dtype).requires_grad_(True)
              for n in names}
    out, _ = function(*(leaves[n] for n in names[:3]), g=leaves["g"], beta=leaves["beta"],
                      use_qk_l2norm_in_kernel=True)
    out.backward(inputs["grad_out"].to(device, out.dtype))
    result = {"out": out.detach().float()}
    result.update({f"d{n}": leaves[n].grad.detach().float() for n in names})
    return result


def check_gated_delta_rule(candidate, reference, shapes, lengths, device, gates=("init", "slow"),
                           bound: float = RELATIVE_ERROR_BOUND) -> list[dict]:
    """Compare ``candidate`` (bf16 inputs, as in training) with ``reference`` (fp32) per shape, length, gate."""
    import torch

    rows = []
    for shape in shapes:
        for tokens in lengths:
            for gate in gates:
                inputs = check_inputs(shape, tokens, gate, device)
                errors = relative_errors(_run(candidate, inputs, upcast=False), _run(reference, inputs, upcast=True))
                rows.append({"heads_k": shape[0], "heads_v": shape[1], "dim_k": shape[2], "dim_v": shape[3],
                             "tokens": tokens, "gate": gate, **verdict(errors, bound)})
                del inputs
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- choosing for a run


INSTALL = "pip install -e '.[gpu]'"  # flash-linear-attention, at the version the checks were made with


def slow_path_warning(status: dict) -> str:
    """What to tell a user whose GPU run takes transformers' torch Gated-DeltaNet because fla does not import
    (``status``: :func:`fla_status`): loudly, with the cost and the fix, since nothing else would show it."""
    return (f"{WARNING_START}flash-linear-attention does not import here ({status.get('error', 'not installed')}), so "
            "Qwen3.5's Gated-DeltaNet layers and their convolution run transformers' torch path on the GPU: 30-60x "
            "slower per layer (on an H200 at 13.4k tokens, 298 ms against 5.2 ms forward and backward). Install it: "
            f"{INSTALL}; or set {ENV}=torch to take the torch path on purpose.")


def planned_slow_paths(meta_model) -> list[str]:
    """Before any GPU time, on a machine with a GPU: the slow path its run would take unasked (a model with
    Gated-DeltaNet layers and no fla that imports), for the probe to say beside its plan."""
    import torch

    if not torch.cuda.is_available() or not layer_shapes(meta_model) or os.environ.get(ENV) == "torch":
        return []
    status = fla_status()
    return [] if status["importable"] else [slow_path_warning(status)]


def gpu_implementation() -> str:
    """What a GPU run in this environment will take, for planning ahead without a GPU or a model:
    torch when asked for, else fla if it is installed (the run still checks it before use)."""
    if os.environ.get(ENV, "auto") == "torch":
        return "torch"
    return "fla" if importlib.util.find_spec("fla") else "torch"


def select_gated_delta_rule(model, device, longest_tokens: int, requested: str | None = None) -> dict:
    """Bind the checked implementation into the model's modeling module(s); return what the run record keeps."""
    requested = requested or os.environ.get(ENV, "auto")
    if requested not in CHOICES:
        raise ConfigError(f"{ENV}={requested!r}: choose one of {', '.join(CHOICES)}")
    shapes = layer_shapes(model)
    record = {"requested": requested, "implementation": None}
    if not shapes:
        record["reason"] = "the model has no Gated-DeltaNet layers"
        return record
    record["layer_shapes"] = [list(shape) for shape in shapes]
    modules = set(shapes.values())
    for module in modules:
        bind_packed_convolution(module)
    references = {m: torch_reference(getattr(m, NAME)) for m in modules}
    record["fla"] = fla_status()
    reason = torch_reason(requested, record["fla"], device, f"{ENV}=fla")
    if reason is None:
        chosen = checked_fla(shapes, references, device, longest_tokens, record)
        record["implementation"] = "fla"
    else:
        chosen = {module: torch_implementation(reference) for module, reference in references.items()}
        record["implementation"], record["reason"] = "torch", reason
    for module, function in chosen.items():
        setattr(module, NAME, function)
    return record


def checked_fla(shapes: dict, references: dict, device, longest_tokens: int, record: dict) -> dict:
    """fla's kernel for each modeling module, once it matched ``references`` at every layer shape on
    every rank (else an error on every rank); the check goes into ``record``."""
    started = time.perf_counter()
    record["hopper_guard_bypassed"] = bypass_hopper_guard()
    lengths = check_lengths(longest_tokens)
    candidates = {module: fla_implementation(reference) for module, reference in references.items()}
    checks = []
    for shape, module in shapes.items():
        checks += check_gated_delta_rule(candidates[module], references[module], [shape], lengths, device)
    record["checks"] = checks
    record["check_seconds"] = time.perf_counter() - started
    failed = [row for row in checks if not row["passed"]]
    if not all_ranks_agree(not failed, device):
        status = record["fla"]
        shown = "; ".join(f"{r['heads_k']}x{r['dim_k']} / {r['heads_v']}x{r['dim_v']} heads, {r['tokens']} tokens, "
                          f"{r['gate']} gates: max relative error {r['max_relative_error']:.3g}" for r in failed[:4])
        raise KernelCheckError(
            f"fla's chunk_gated_delta_rule (fla {status.get('version')}, Triton {status.get('triton')}, Hopper guard "
            f"bypassed: {record['hopper_guard_bypassed']}) disagrees with transformers' torch implementation beyond "
            f"{RELATIVE_ERROR_BOUND:g} on this or another rank: {shown or 'see the other rank'}. "
            f"Set {ENV}=torch to train with the torch implementation (slow, exact) instead.")
    return candidates


# ---------------------------------------------------------------- standalone check (benchmarks)


def time_forward_backward(function, inputs: dict, repeats: int = 3) -> float:
    """Milliseconds for one forward + backward with bf16 inputs, as in training."""
    import torch

    # time the kernels, not the copies from the host
    inputs = {k: v.to(inputs["device"]) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return milliseconds_per_call(lambda: _run(function, inputs, upcast=False), inputs["device"], repeats)


def main(argv: list[str] | None = None) -> int:
    """Check fla against the torch implementation at a model's layer shapes; print one JSON object.

        python -m videosft.kernels.gated_deltanet --model-config bench/configs/Qwen3.5-4B.json --tokens 13386 8192 201
    """
    import json

    import torch

    args = check_parser(main.__doc__, "also time forward + backward of both implementations").parse_args(argv)
    config = json.loads(args.model_config.read_text())
    text = config.get("text_config", config)
    shape = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
             text["linear_value_head_dim"])
    module = importlib.import_module(family_of(text.get("model_type", config["model_type"])).modeling_module)
    reference = torch_reference(getattr(module, NAME))
    device = torch.device(args.device)
    result = {"shape": list(shape), "fla": fla_status(), "bound": RELATIVE_ERROR_BOUND}
    result["hopper_guard_bypassed"] = bypass_hopper_guard() if result["fla"]["importable"] else False
    candidate = fla_implementation(reference) if result["fla"]["importable"] else torch_implementation(reference)
    result["candidate"] = candidate.implementation
    result["checks"] = check_gated_delta_rule(candidate, reference, [shape], args.tokens, device)
    if args.time and device.type == "cuda":
        inputs = check_inputs(shape, max(args.tokens), "init", device)
        result["milliseconds_forward_backward"] = {
            "tokens": max(args.tokens), candidate.implementation: time_forward_backward(candidate, inputs),
            "torch": time_forward_backward(torch_implementation(reference), inputs)}
    print(json.dumps(result))
    return 0 if all(row["passed"] for row in result["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

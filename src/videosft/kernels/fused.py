"""Fused elementwise kernels around the language model's linear layers, checked before they are bound.

Between its matrix products a Qwen decoder layer runs many small elementwise kernels: RMSNorm in
fp32 with casts on either side, the MLP's ``act_fn(gate) * up``, the Gated-DeltaNet's gated norm
and its depthwise causal convolution. Together they were a fifth of device time in a profile.
flash-linear-attention (``fla``) has one Triton kernel for each forward and one for each backward:

=========================  ==================================================  =====================================
kind                       transformers (what it replaces)                     fla 0.6.0 function
=========================  ==================================================  =====================================
``rms_norm_zero_centered`` ``Qwen3_5RMSNorm.forward``: norm(x) * (1 + w)       ``fla.modules.norm.layernorm``'s kernels
                                                                               with the fp32 weight ``1 + w``, launched
                                                                               by :mod:`videosft.kernels.norms`
``rms_norm``               ``Qwen3VLTextRMSNorm`` / ``Qwen2_5_VLRMSNorm``      the same, weight w
                           ``.forward``: w * norm(x)
``rms_norm_gated``         ``Qwen3_5RMSNormGated.forward``:                    ``fla.modules.norm.fused_norm_gate``
                           w * norm(x) * silu(gate)                            ``.rms_norm_gated``
``swiglu``                 ``Qwen3_5MLP`` / ``Qwen3VLTextMLP`` / ``Qwen2MLP``  ``fla.modules.activations.swiglu``
                           ``.forward``: act_fn(gate_proj(x)) * up_proj(x)     (the projections stay the module's own,
                                                                               LoRA-wrapped or not)
``causal_conv1d``          the modeling module's ``causal_conv1d_fn``          ``fla.modules.causal_conv1d``
                           (hidden [B, D, T], weight [D, K], silu)             ``.causal_conv1d`` on the [B, T, D]
                                                                               view, Triton backend
=========================  ==================================================  =====================================

How it is chosen, as :mod:`videosft.kernels.gated_deltanet` does for the Gated-DeltaNet:

* ``requested`` = ``auto`` (fla on a CUDA device when it imports, else nothing changes), ``fla``
  (an error if fla cannot run) or ``torch`` (transformers' forwards, undoing an earlier binding);
  ``VIDEOSFT_FUSED_KERNELS`` overrides the argument when set.
* Modules are found by behaviour, not by class name: a module with one 1-D ``weight`` and an eps
  attribute whose class forward, run on probe tensors, equals w * norm(x) (or (1 + w) * norm(x), or
  w * norm(x) * silu(gate)) with that eps; an MLP whose forward equals silu(gate) * up when its
  projections are replaced by fixed tensors. Anything else keeps its forward and is listed under
  ``unrecognized``. Only the language model is searched (``get_decoder()``), never the vision
  tower, whose Qwen2.5-VL RMSNorms and MLPs look the same.
* Before anything is bound, every distinct (kind, class, shape) is checked on the device: the fused
  forward with bf16 inputs against the module's original forward with the same values in fp32
  (TF32 off), output and the gradient of every input and of the weight, relative error
  ||x - ref|| / ||ref|| <= :data:`videosft.kernels.checks.RELATIVE_ERROR_BOUND`, at the lengths of
  :func:`videosft.kernels.checks.check_lengths`: the run's longest sequence (capped at 8192 tokens)
  and 201 tokens (:data:`videosft.kernels.checks.CHECK_SHORT_TOKENS` says why 201). Norms over heads
  get tokens x heads rows, as in the model. Weights are random (the built ones are all zeros or all
  ones, which would hide w vs 1 + w) and tensors are fresh: under ZeRO-3 a module's own parameters
  are empty outside its forward.
* A failed check is an error on every rank naming the kernel, the shape and the switch; never a
  silent fallback. Each check row also carries the torch forward's own error in bf16, for scale.
* Module forwards are replaced per instance (``module.forward``, a bound method), and they read
  ``self.weight`` when called, after DeepSpeed's pre-forward hook has gathered it. The causal
  convolution is a module-level function, so it is rebound in the modeling module, like
  ``torch_chunk_gated_delta_rule`` in :mod:`videosft.kernels.gated_deltanet`.

Rounding. fla computes each fused expression in fp32 and rounds once, to the input's dtype;
transformers rounds in between. In bf16 training:

* zero-centered RMSNorm: torch normalises in fp32, multiplies by (1 + w) in fp32 and rounds once;
  fla (given the fp32 tensor ``1 + w``) does the same, in another reduction order. Same result to
  about one fp32 ulp before the final rounding; dw is accumulated in fp32 and flows back through
  ``1 + w.float()`` to w's dtype, as in torch.
* RMSNorm: torch rounds norm(x) to x's dtype, then w * that rounds again (output dtype: the
  promotion of w's and x's dtypes). fla multiplies in fp32 and rounds once; the result is cast to
  the promoted dtype when the two differ (not in bf16 training).
* gated RMSNorm: torch rounds norm(x), then w * norm(x) (bf16), then multiplies by silu(gate) in
  fp32 and rounds: three roundings; fla one. d(gate) comes back in x's dtype.
* SwiGLU: torch rounds silu(gate), then silu(gate) * up: two roundings; fla one. Both gradients
  are computed in fp32 and rounded to the inputs' dtypes.
* causal conv1d: torch convolves in the weight's dtype (bf16 in, fp32 accumulate in cuDNN) and
  applies silu in bf16; fla accumulates and applies silu in fp32, rounding once (to nearest even).
  dw is summed over 64-token chunks in fp32 and cast to w's dtype.

So fla is nearer the fp32 reference than the bf16 torch path it replaces; the check rows show both.
Packed samples (``cu_seq_lens_q`` reaching the convolution, ``train.pack_tokens``) go to fla's
kernel as ``cu_seqlens``, which restarts the convolution at each boundary; the check here runs
unpacked, so a packed run's equality with unpacked samples is measured by ``bench/packing.py``.

    python -m videosft.kernels.fused --model-config bench/configs/Qwen3.5-4B.json --tokens 13386 201 --time
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import types
from dataclasses import dataclass, field

from ..kernels.checks import (RELATIVE_ERROR_BOUND, KernelCheckError, all_ranks_agree, check_lengths, check_parser,
                              exact_fp32, fla_import_status, milliseconds_per_call, relative_errors, requested_choice,
                              torch_reason, verdict)
from ..kernels.gated_deltanet import CONV_NAME, per_sample

ENV = "VIDEOSFT_FUSED_KERNELS"
KINDS = ("rms_norm_zero_centered", "rms_norm", "rms_norm_gated", "swiglu", "causal_conv1d")
# what each kind binds, for the record and for error messages
FLA_FUNCTIONS = {
    "rms_norm_zero_centered": "videosft.kernels.norms.rms_norm (fla's layernorm kernels; weight 1 + w in fp32)",
    "rms_norm": "videosft.kernels.norms.rms_norm (fla's layernorm kernels)",
    "rms_norm_gated": "fla.modules.norm.fused_norm_gate.rms_norm_gated",
    "swiglu": "fla.modules.activations.swiglu",
    "causal_conv1d": "fla.modules.causal_conv1d.causal_conv1d",
}
FLA_MODULES = ("fla.modules.norm.layernorm", "fla.modules.norm.fused_norm_gate", "fla.modules.activations",
               "fla.modules.causal_conv1d")
EPS_ATTRIBUTES = ("variance_epsilon", "eps")
CONV_ACTIVATIONS = ("silu", "swish")


# ---------------------------------------------------------------- what is replaced


@dataclass
class Site:
    """One module whose forward (or whose modeling module's convolution) a fused kernel replaces."""

    kind: str
    name: str  # qualified name inside the language model
    module: object  # the module instance (for causal_conv1d: the Gated-DeltaNet calling it)
    shape: dict  # what the check builds its tensors from
    eps_attribute: str | None = None  # norms: where the module keeps eps
    modeling: object = field(default=None, repr=False)  # causal_conv1d: the modeling module binding the name

    def key(self) -> tuple:
        """Sites with the same key run the same kernel code on the same shapes: one check covers them."""
        owner = self.modeling.__name__ if self.kind == "causal_conv1d" else type(self.module).__qualname__
        return (self.kind, owner, tuple(sorted(self.shape.items())))


def language_model(model):
    """The text decoder of a (vision-)language model, so the vision tower is never touched."""
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            return get_decoder()
        except Exception:  # a model with no rule for its decoder: search all of it
            return model
    return model


def _full_shape(parameter) -> tuple:
    """A parameter's shape, also when ZeRO-3 has partitioned it to shape (0,) (it keeps ``ds_shape``)."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))


class _Returns:
    """Stand-in projection for probes and checks: returns a fixed tensor whatever its input."""

    def __init__(self, value):
        self.value = value

    def __call__(self, _input):
        return self.value


def stand_in(module, tensors: dict | None = None, submodules: dict | None = None):
    """A copy of ``module`` without hooks whose forward reads ``tensors`` (e.g. ``weight``) and ``submodules``.

    Same class and plain attributes (eps, activation, config), so the class forward runs unchanged;
    fresh parameters, because the module's own may be ZeRO-3 partitions or on the meta device;
    no hooks, so DeepSpeed's parameter coordinator never sees the probe.
    """
    import torch

    clone = type(module).__new__(type(module))
    torch.nn.Module.__init__(clone)
    fresh = set(vars(clone))
    for key, value in vars(module).items():
        if key not in fresh and key != "forward" and not isinstance(value, torch.Tensor):
            clone.__dict__[key] = value
    for name, child in module.named_children():
        if name not in (submodules or {}):
            clone._modules[name] = stand_in(child)
    for name, replacement in (submodules or {}).items():
        if isinstance(replacement, torch.nn.Module):
            clone._modules[name] = replacement
        else:
            clone.__dict__[name] = replacement
    clone.__dict__.update(tensors or {})  # plain attributes shadow nothing: _parameters is empty
    return clone


def _positional_inputs(forward) -> int:
    parameters = list(inspect.signature(forward).parameters.values())[1:]  # after self
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def _close(out, expected) -> bool:
    import torch

    return out.shape == expected.shape and bool(torch.allclose(out.float(), expected, rtol=1e-4, atol=1e-5))


def probe_norm(module, dim: int, eps: float) -> str | None:
    """The norm kind whose formula the module's class forward follows with this eps, else None (fp32, CPU)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    # one row small enough that eps matters (var 1e-8), so a module using another eps is not taken
    scales = torch.tensor([1e-4, 1.0, 3.0, 30.0])[:, None]
    x = torch.randn(4, dim, generator=generator) * scales
    weight = torch.rand(dim, generator=generator) * 1.75 - 0.75  # neither 0 nor 1: w and 1 + w differ
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    forward = type(module).forward
    try:
        with torch.no_grad():
            if _positional_inputs(forward) == 1:
                out = forward(stand_in(module, {"weight": weight}), x)
                if _close(out, normed * weight):
                    return "rms_norm"
                if _close(out, normed * (1 + weight)):
                    return "rms_norm_zero_centered"
            elif _positional_inputs(forward) == 2:
                gate = torch.randn(4, dim, generator=generator) * 3
                out = forward(stand_in(module, {"weight": weight}), x, gate)
                if _close(out, normed * weight * F.silu(gate)):
                    return "rms_norm_gated"
    except Exception:  # a forward that cannot run on the probe is not one of ours
        return None
    return None


def probe_swiglu_mlp(module) -> bool:
    """Whether the class forward is down_proj(silu(gate_proj(x)) * up_proj(x)), with the module's act_fn."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 8, generator=generator) * 4, torch.randn(3, 8, generator=generator)
    # x differs from both, so a forward that also used x itself would not match
    x = torch.randn(3, 8, generator=generator)
    try:
        with torch.no_grad():
            clone = stand_in(module, submodules={"gate_proj": _Returns(gate), "up_proj": _Returns(up),
                                                 "down_proj": torch.nn.Identity()})
            return _close(type(module).forward(clone, x), F.silu(gate) * up)
    except Exception:  # a forward that cannot run on the probe is not one of ours
        return False


def _rows_per_token(parent, child_name: str) -> int:
    """How many rows a norm sees per token: its heads for per-head norms, else 1 (only sizes the check)."""
    attributes = {"norm": ("num_v_heads",), "q_norm": ("num_heads", "num_attention_heads"),
                  "k_norm": ("num_key_value_heads", "num_kv_heads")}.get(child_name, ())
    for attribute in attributes:
        for source in (parent, getattr(parent, "config", None)):
            value = getattr(source, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 1


def _norm_site(name, module, parent, child_name):
    """A Site for a recognised RMSNorm, ``"unrecognized"`` for a norm-like module that is not one, else None."""
    parameters = dict(module.named_parameters(recurse=False))
    if set(parameters) != {"weight"} or len(_full_shape(parameters["weight"])) != 1 or list(module.children()):
        return None
    epsilons = [(a, getattr(module, a)) for a in EPS_ATTRIBUTES
                if isinstance(getattr(module, a, None), (int, float)) and not isinstance(getattr(module, a), bool)]
    if not epsilons:
        return None
    dim = _full_shape(parameters["weight"])[0]
    for attribute, eps in epsilons:
        kind = probe_norm(module, dim, float(eps))
        if kind:
            return Site(kind, name, module, {"dim": dim, "eps": float(eps),
                                             "rows_per_token": _rows_per_token(parent, child_name)}, attribute)
    return "unrecognized"


def _swiglu_site(name, module):
    children = dict(module.named_children())
    if not {"gate_proj", "up_proj", "down_proj"} <= set(children):
        return None
    intermediate = getattr(children["gate_proj"], "out_features", None)  # nn.Linear and peft's LoRA layers
    if not isinstance(intermediate, int) or not probe_swiglu_mlp(module):
        return "unrecognized"
    return Site("swiglu", name, module, {"intermediate": intermediate})


def _conv_site(name, module):
    import torch

    conv = getattr(module, "conv1d", None)
    modeling = sys.modules.get(type(module).__module__)
    if not isinstance(conv, torch.nn.Conv1d) or not callable(getattr(modeling, CONV_NAME, None)):
        return None
    if not (conv.groups == conv.in_channels == conv.out_channels):
        return None
    if getattr(module, "activation", None) not in CONV_ACTIVATIONS:  # fla's kernel has silu or nothing
        return "unrecognized"
    shape = {"channels": conv.in_channels, "width": conv.kernel_size[0], "bias": conv.bias is not None,
             "activation": module.activation}
    return Site("causal_conv1d", name, module, shape, modeling=modeling)


def find_sites(model) -> tuple[list[Site], dict[str, int]]:
    """Every replaceable module of the language model, and the norm/MLP-like classes left alone (name -> count)."""
    decoder = language_model(model)
    sites, unrecognized, seen = [], {}, set()
    for parent_name, parent in decoder.named_modules():
        for child_name, module in parent.named_children():
            if id(module) in seen:
                continue
            seen.add(id(module))
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            for found in (_norm_site(name, module, parent, child_name), _swiglu_site(name, module),
                          _conv_site(name, module)):
                if isinstance(found, Site):
                    sites.append(found)
                elif found == "unrecognized":
                    unrecognized[type(module).__name__] = unrecognized.get(type(module).__name__, 0) + 1
    return sites, unrecognized


# ---------------------------------------------------------------- kernels and forwards


def fla_status() -> dict:
    """Whether fla's four modules import (Triton included), and the versions."""
    return fla_import_status(FLA_MODULES)


def fla_kernels() -> dict:
    """fla 0.6.0's functions, by the name the forwards below call them (its RMSNorm kernels launched
    without a compile per sequence length: :mod:`videosft.kernels.norms`)."""
    from fla.modules.activations import swiglu
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    from ..kernels.norms import rms_norm

    return {"rms_norm": rms_norm, "rms_norm_gated": rms_norm_gated, "swiglu": swiglu, "causal_conv1d": causal_conv1d}


def torch_kernels() -> dict:
    """fla's four functions in torch, same signatures, layouts and output dtypes (fp32 inside, one rounding).

    Slower than transformers' own code; they exist to run the check and the binding without a GPU.
    """
    import torch
    import torch.nn.functional as F

    def normalised(x, eps):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("residual / prenorm are not used here")
        out = normalised(x, eps) * weight.float()
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                       eps=1e-6):
        if residual is not None or prenorm or activation not in ("swish", "silu"):
            raise NotImplementedError("only the silu gate without residual is used here")
        out = normalised(x, eps) * weight.float()
        out = out if bias is None else out + bias.float()
        return (out * F.silu(g.float())).to(x.dtype)

    def swiglu(x, y):
        return (F.silu(x.float()) * y.float()).to(x.dtype)

    def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend="triton", cu_seqlens=None, **kwargs):
        if residual is not None or initial_state is not None or output_final_state:
            raise NotImplementedError("only the plain causal convolution is used here")
        if cu_seqlens is not None:  # as fla: each packed sample from zeros
            return per_sample(lambda part: causal_conv1d(part, weight, bias, activation=activation)[0],
                              cu_seqlens, 1, x), None
        channels, width = weight.shape
        padded = F.pad(x.float().transpose(1, 2), (width - 1, 0))  # [B, D, K - 1 + T]
        out = F.conv1d(padded, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=channels)
        if activation in CONV_ACTIVATIONS:
            out = F.silu(out)
        return out.transpose(1, 2).to(x.dtype), None

    return {"rms_norm": rms_norm, "rms_norm_gated": rms_norm_gated, "swiglu": swiglu, "causal_conv1d": causal_conv1d}


def zero_centered_rms_norm_forward(rms_norm, eps_attribute: str):
    def forward(self, hidden_states):
        # 1 + w in fp32, as the module computes it, so the kernel rounds only once, at the end
        return rms_norm(hidden_states, 1.0 + self.weight.float(), None, eps=getattr(self, eps_attribute))

    return forward


def rms_norm_forward(rms_norm, eps_attribute: str):
    import torch

    def forward(self, hidden_states):
        weight = self.weight
        out = rms_norm(hidden_states, weight, None, eps=getattr(self, eps_attribute))
        dtype = torch.promote_types(weight.dtype, hidden_states.dtype)  # what w * norm(x) returns in torch
        return out if out.dtype == dtype else out.to(dtype)

    return forward


def gated_rms_norm_forward(rms_norm_gated, eps_attribute: str):
    def forward(self, hidden_states, gate):
        # "silu" because the probe found silu, whatever the attribute is called
        return rms_norm_gated(hidden_states, gate, self.weight, None, activation="silu",
                              eps=getattr(self, eps_attribute))

    return forward


def swiglu_mlp_forward(swiglu):
    def forward(self, x):
        # the projections stay the module's own: peft may have wrapped them with LoRA
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    return forward


def causal_conv1d_forward(reference, causal_conv1d):
    """fla's convolution behind transformers' signature.

    transformers calls ``causal_conv1d_fn(hidden [B, D, T], weight [D, K], bias, activation=...)``;
    fla's ``causal_conv1d(x=[B, T, D], weight=[D, K], bias, activation=...)`` returns ([B, T, D], state).
    """

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if activation not in (None, *CONV_ACTIVATIONS):
            raise ValueError(f"fla's causal_conv1d has silu or no activation, not {activation!r}")
        if kwargs.get("seq_idx") is not None:
            raise ValueError(f"seq_idx reaches the causal convolution; packed samples are marked by cu_seq_lens_q "
                             f"here. Set {ENV}=torch.")
        # transformers' [B, D, T] is a transpose of the projection's [B, T, D] output: fla reads it in place.
        # Packed samples (train.pack_tokens): fla restarts the convolution at each boundary itself.
        out, _ = causal_conv1d(x=hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation,
                               cu_seqlens=kwargs.get("cu_seq_lens_q"))
        return out.transpose(1, 2)

    causal_conv1d_fn.__wrapped__ = reference  # inspect.unwrap finds transformers' torch function again
    return causal_conv1d_fn


def fused_forward(site: Site, kernels: dict):
    """The replacement for one site, calling ``kernels`` (fla's, or :func:`torch_kernels` for tests)."""
    if site.kind == "rms_norm_zero_centered":
        return zero_centered_rms_norm_forward(kernels["rms_norm"], site.eps_attribute)
    if site.kind == "rms_norm":
        return rms_norm_forward(kernels["rms_norm"], site.eps_attribute)
    if site.kind == "rms_norm_gated":
        return gated_rms_norm_forward(kernels["rms_norm_gated"], site.eps_attribute)
    if site.kind == "swiglu":
        return swiglu_mlp_forward(kernels["swiglu"])
    if site.kind == "causal_conv1d":
        return causal_conv1d_forward(reference_forward(site), kernels["causal_conv1d"])
    raise ValueError(f"unknown kind {site.kind!r}")


def reference_forward(site: Site):
    """What the site runs without us: the class forward, or transformers' torch convolution."""
    if site.kind == "causal_conv1d":
        return inspect.unwrap(getattr(site.modeling, CONV_NAME))
    return type(site.module).forward


# ---------------------------------------------------------------- binding


def _is_ours(function) -> bool:
    return getattr(function, "fused_kind", None) in KINDS


def refuse_foreign_forwards(sites: list[Site]) -> None:
    """Fail before anything is bound (or checked) if a module already has a forward on the instance."""
    for site in sites:
        existing = None if site.kind == "causal_conv1d" else site.module.__dict__.get("forward")
        if existing is not None and not _is_ours(existing):
            raise ValueError(f"{site.name} ({type(site.module).__name__}) already has its own forward on the "
                             f"instance ({existing!r}, an accelerate hook?); replacing it would drop that. "
                             f"Set {ENV}=torch.")


def bind(sites: list[Site], kernels: dict, implementation: str) -> dict[str, int]:
    """Replace every site's forward (convolution: the modeling module's function); counts per kind."""
    refuse_foreign_forwards(sites)
    counts = dict.fromkeys(KINDS, 0)
    rebound = set()
    for site in sites:
        counts[site.kind] += 1
        if site.kind == "causal_conv1d":
            if site.modeling.__name__ in rebound:
                continue
            rebound.add(site.modeling.__name__)
            current = getattr(site.modeling, CONV_NAME)
            function = fused_forward(site, kernels)
            # what transformers had bound (its hub wrapper), kept through rebinding so unbind restores it
            function.replaced = current.replaced if _is_ours(current) else current
            function.fused_kind, function.implementation = site.kind, implementation
            setattr(site.modeling, CONV_NAME, function)
            continue
        function = fused_forward(site, kernels)
        function.fused_kind, function.implementation = site.kind, implementation
        site.module.forward = types.MethodType(function, site.module)
    return counts


def unbind(sites: list[Site]) -> None:
    """Give every site back transformers' forward (undo :func:`bind`)."""
    for site in sites:
        if site.kind == "causal_conv1d":
            current = getattr(site.modeling, CONV_NAME)
            if _is_ours(current):
                setattr(site.modeling, CONV_NAME, current.replaced)
        elif _is_ours(site.module.__dict__.get("forward")):
            del site.module.forward


# ---------------------------------------------------------------- the check


def check_inputs(site: Site, tokens: int, device="cpu", seed: int = 0) -> dict:
    """bf16 leaves as the site sees them in training, plus ``grad_out`` (the output's gradient).

    Drawn on ``device``: at 8192 tokens an MLP's inputs are hundreds of millions of numbers.
    """
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator, device=device)

    def scales(dim):  # applied weights from 0.25 to 2: a wrong w vs 1 + w is far off
        return torch.rand(dim, generator=generator, device=device) * 1.75 + 0.25

    bf16 = torch.bfloat16
    if site.kind in ("rms_norm", "rms_norm_zero_centered", "rms_norm_gated"):
        dim, rows = site.shape["dim"], tokens * site.shape["rows_per_token"]
        # rows from 1e-3 to 1e2 in size: the small ones are where eps matters
        row_scale = torch.exp(torch.empty(rows, 1, device=device).uniform_(-6.9, 4.6, generator=generator))
        inputs = {"hidden_states": (randn(rows, dim) * row_scale).to(bf16)}
        weight = scales(dim)
        inputs["weight"] = (weight - 1 if site.kind == "rms_norm_zero_centered" else weight).to(bf16)
        if site.kind == "rms_norm_gated":
            inputs["gate"] = (randn(rows, dim) * 2).to(bf16)
        inputs["grad_out"] = randn(rows, dim).to(bf16)
    elif site.kind == "swiglu":
        size = (tokens, site.shape["intermediate"])
        inputs = {"gate": (randn(*size) * 2).to(bf16), "up": randn(*size).to(bf16), "grad_out": randn(*size).to(bf16)}
    elif site.kind == "causal_conv1d":
        channels, width = site.shape["channels"], site.shape["width"]
        inputs = {"hidden_states": randn(1, tokens, channels).to(bf16),  # [B, T, D], transposed when called
                  "weight": (randn(channels, width) / width**0.5).to(bf16)}
        if site.shape["bias"]:
            inputs["bias"] = (randn(channels) * 0.1).to(bf16)
        # the gradient arrives as [B, D, T] through a transpose, as in the layer
        inputs["grad_out"] = randn(1, tokens, channels).to(bf16).transpose(1, 2)
    else:
        raise ValueError(f"unknown kind {site.kind!r}")
    return inputs


def _call(site: Site, forward, leaves: dict):
    """Run ``forward`` (a site's original or fused forward) on the leaves, through a hook-free stand-in."""
    import torch

    if site.kind == "causal_conv1d":
        return forward(leaves["hidden_states"].transpose(1, 2), leaves["weight"], leaves.get("bias"),
                       activation=site.shape["activation"])
    if site.kind == "swiglu":
        module = stand_in(site.module, submodules={"gate_proj": _Returns(leaves["gate"]),
                                                   "up_proj": _Returns(leaves["up"]), "down_proj": torch.nn.Identity()})
        return forward(module, leaves["gate"])
    module = stand_in(site.module, {"weight": leaves["weight"]})
    if site.kind == "rms_norm_gated":
        return forward(module, leaves["hidden_states"], leaves["gate"])
    return forward(module, leaves["hidden_states"])


def _run(site: Site, forward, inputs: dict, device, upcast: bool) -> dict:
    """Output and the gradient of every leaf (all in fp32 when ``upcast``)."""
    import torch

    leaves = {name: tensor.detach().to(device, torch.float32 if upcast else tensor.dtype).requires_grad_(True)
              for name, tensor in inputs.items() if name != "grad_out"}
    out = _call(site, forward, leaves)
    out.backward(inputs["grad_out"].to(device, out.dtype))
    result = {"out": out.detach().float()}
    # a kernel that drops a gradient shows as a relative error of 1
    result.update({f"d{name}": (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach().float()
                   for name, leaf in leaves.items()})
    return result


def distinct_sites(sites: list[Site]) -> list[Site]:
    """One site per key, in model order."""
    chosen = {}
    for site in sites:
        chosen.setdefault(site.key(), site)
    return list(chosen.values())


def check_sites(sites: list[Site], kernels: dict, lengths, device, bound: float = RELATIVE_ERROR_BOUND) -> list[dict]:
    """Fused forwards (bf16 inputs) against the original forwards (same values in fp32), per distinct shape."""
    import torch

    rows = []
    with exact_fp32():
        for site in distinct_sites(sites):
            candidate, reference = fused_forward(site, kernels), reference_forward(site)
            for tokens in lengths:
                inputs = check_inputs(site, tokens, device)
                expected = _run(site, reference, inputs, device, upcast=True)
                errors = relative_errors(_run(site, candidate, inputs, device, upcast=False), expected)
                # the torch forward's own error in bf16: what the fused kernel's error compares with
                baseline = relative_errors(_run(site, reference, inputs, device, upcast=False), expected)
                rows.append({"kernel": site.kind, "class": type(site.module).__name__, "shape": dict(site.shape),
                             "tokens": tokens, **verdict(errors, bound),
                             "torch_bf16_max_relative_error": max(baseline.values())})
                del inputs, expected
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def describe_failures(rows: list[dict], limit: int = 4) -> str:
    described = []
    for row in rows[:limit]:
        shape = ", ".join(f"{k}={v}" for k, v in row["shape"].items())
        errors = ", ".join(f"{k} {v:.3g}" for k, v in row["relative_errors"].items())
        described.append(f"{row['kernel']} ({FLA_FUNCTIONS[row['kernel']]}) in {row['class']} at {shape}, "
                         f"{row['tokens']} tokens: max relative error {row['max_relative_error']:.3g} ({errors})")
    return "; ".join(described)


def check_and_bind(sites: list[Site], kernels: dict, device, longest_tokens: int, implementation: str = "fla",
                   bound: float = RELATIVE_ERROR_BOUND) -> dict:
    """Check every distinct shape, raise on every rank if any fails, else bind; what the run record keeps."""
    refuse_foreign_forwards(sites)  # before spending the check's time
    started = time.perf_counter()
    try:
        rows, error = check_sites(sites, kernels, check_lengths(longest_tokens), device, bound), None
    except Exception as raised:  # a kernel that does not compile or run: the other ranks must not wait for us
        rows, error = [], raised
    seconds = time.perf_counter() - started
    failed = [row for row in rows if not row["passed"]]
    if not all_ranks_agree(error is None and not failed, device):
        if error is not None:
            raise KernelCheckError(f"checking the fused kernels raised {type(error).__name__}: {error}. "
                                   f"Set {ENV}=torch to train with transformers' torch forwards instead.") from error
        raise KernelCheckError(
            f"fused kernels disagree with transformers' forwards (run in fp32) beyond {bound:g} on this or another "
            f"rank: {describe_failures(failed) or 'see the other rank'}. Set {ENV}=torch to train with "
            f"transformers' torch forwards instead.")
    replaced = bind(sites, kernels, implementation)
    kinds = {site.kind for site in sites}
    return {"implementation": {kind: implementation if kind in kinds else None for kind in KINDS},
            "replaced": replaced, "checks": rows, "check_seconds": seconds}


# ---------------------------------------------------------------- choosing for a run


def select_fused_kernels(model, device, longest_tokens: int, requested: str = "auto") -> dict:
    """Bind fla's fused kernels into the language model after checking them; return what the run record keeps.

    ``longest_tokens``: the longest sequence of the run, from which
    :func:`videosft.kernels.checks.check_lengths` takes the lengths checked.
    """
    import torch

    requested, from_env = requested_choice(requested, ENV)
    device = torch.device(device)
    sites, unrecognized = find_sites(model)
    found = dict.fromkeys(KINDS, 0)
    for site in sites:
        found[site.kind] += 1
    record = {"requested": requested, "requested_by": ENV if from_env else "argument",
              "implementation": dict.fromkeys(KINDS), "modules": found, "replaced": dict.fromkeys(KINDS, 0),
              "unrecognized": unrecognized, "functions": {k: FLA_FUNCTIONS[k] for k in KINDS if found[k]}}
    if not sites:
        record["reason"] = "nothing in the language model to replace"
        return record
    record["fla"] = fla_status()
    reason = torch_reason(requested, record["fla"], device, f"{ENV}=fla" if from_env else "requested='fla'")
    if reason is not None:
        unbind(sites)  # "torch" means transformers' forwards, also after an earlier selection
        record["implementation"] = {kind: "torch" if found[kind] else None for kind in KINDS}
        record["reason"] = reason
        return record
    record.update(check_and_bind(sites, fla_kernels(), device, longest_tokens, "fla"))
    return record


# ---------------------------------------------------------------- standalone check (benchmarks)


def time_forward_backward(site: Site, forward, inputs: dict, device, repeats: int = 5) -> float:
    """Milliseconds for one forward + backward with bf16 inputs, as in training."""
    inputs = {k: v.to(device) for k, v in inputs.items()}  # time the kernels, not copies from the host
    return milliseconds_per_call(lambda: _run(site, forward, inputs, device, upcast=False), device, repeats)


def build_meta_model(config_path):
    """A model config.json's model on the meta device (shapes only)."""
    import json

    import torch
    from transformers import AutoConfig

    from ..models.checkpoint import model_class

    values = json.loads(config_path.read_text())
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    cls = model_class(config)
    with torch.device("meta"):
        return cls._from_config(config)


def main(argv: list[str] | None = None) -> int:
    """Check the fused kernels against transformers' forwards at a model's shapes; print one JSON object.

        python -m videosft.kernels.fused --model-config bench/configs/Qwen3.5-4B.json --tokens 13386 201 --time

    Without fla (or without a GPU: --device cpu) the candidate is the torch emulation of fla's functions,
    which checks this machinery only.
    """
    import json

    import torch

    args = check_parser(main.__doc__, "also time forward + backward, fused vs torch").parse_args(argv)
    device = torch.device(args.device)
    sites, unrecognized = find_sites(build_meta_model(args.model_config))
    status = fla_status()
    use_fla = status["importable"] and device.type == "cuda"
    kernels = fla_kernels() if use_fla else torch_kernels()
    counts = dict.fromkeys(KINDS, 0)
    for site in sites:
        counts[site.kind] += 1
    result = {"model_config": str(args.model_config), "fla": status,
              "candidate": "fla" if use_fla else "torch emulation", "bound": RELATIVE_ERROR_BOUND, "modules": counts,
              "unrecognized": unrecognized, "checks": check_sites(sites, kernels, args.tokens, device)}
    if args.time:
        timings = []
        for site in distinct_sites(sites):
            inputs = check_inputs(site, max(args.tokens), device)
            # the original as training runs it now: the class forward, or whatever transformers bound
            # (its torch convolution, or the causal_conv1d package's when that is installed)
            original = getattr(site.modeling, CONV_NAME) if site.kind == "causal_conv1d" else reference_forward(site)
            fused_ms = time_forward_backward(site, fused_forward(site, kernels), inputs, device)
            original_ms = time_forward_backward(site, original, inputs, device)
            timings.append({"kernel": site.kind, "class": type(site.module).__name__, "shape": site.shape,
                            "modules": sum(s.key() == site.key() for s in sites), "tokens": max(args.tokens),
                            "fused": fused_ms, "original": original_ms,
                            "original_is": f"{original.__module__}.{original.__qualname__}",
                            "speedup": original_ms / fused_ms if fused_ms > 0 else None})
            del inputs
        result["milliseconds_forward_backward"] = timings
    print(json.dumps(result))
    return 0 if all(row["passed"] for row in result["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

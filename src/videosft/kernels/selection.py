"""Which kernels a training run (or a model answering prompts, :func:`for_generation`) binds, in one
place: fla's autotune table, the Gated-DeltaNet, the fused elementwise kernels, the vision tower's
batched attention, packed attention and PyTorch's SDPA backends. Each fla kernel is bound only after it
matches transformers' torch forward at the run's shapes (:mod:`videosft.kernels.checks`); what was bound is
the run record's ``kernels`` entry.
"""

from __future__ import annotations

from pathlib import Path

from . import attention_backends, autotune, packed_attention, vision_attention
from .fused import select_fused_kernels
from .gated_deltanet import select_gated_delta_rule, slow_path_warning


def before_build(meta_model, device, longest_tokens: int, autotune_table: tuple[Path, str, str] | None) -> dict:
    """What is chosen before the weights take device memory: the autotune table (before the kernel checks,
    the first to run fla's kernels), and the Gated-DeltaNet, whose check binds a function of the modeling
    module and needs only the layers' shapes (its fp32 reference took 3.1 GiB more at 64 frames, enough
    to break a 12 GiB card's plan). ``autotune_table``: where to save this GPU's choices when stopped."""
    autotuned = autotune.apply(device)
    if autotune_table is not None and device.type == "cuda":
        autotune.save_when_stopped(*autotune_table)
    return {"autotune": autotuned, "gated_deltanet": select_gated_delta_rule(meta_model, device, longest_tokens)}


def bind(model, chosen: dict, device, longest_tokens: int, fused: str, packed: bool, padded: bool) -> dict:
    """The rest, on the built model: the fused kernels (checked at ``longest_tokens``, a whole pack when
    packing), one vision attention per layer with its rotary embedding in one kernel (checked bit for bit;
    ``fused`` = ``torch`` keeps transformers' function), the language model's causal attention per sample
    (a pack's or the one sample's, bucketed onto cuDNN's kernel on Hopper), and the SDPA backends for
    padded or unpadded micro-batches."""
    rotary, batched = vision_attention.bind(model, device, fused)
    bound = {**chosen,
             "fused": select_fused_kernels(model, device, longest_tokens, fused),
             "vision_rotary": rotary,
             "vision_attention_batched": batched,
             "packed_attention": packed_attention.bind(model) if packed or not padded else None,
             "attention": attention_backends.for_batches(device, padded=padded)}
    bound["warnings"] = slow_paths(bound, device)
    return bound


def for_generation(model, device, longest_tokens: int) -> dict:
    """What a model answering prompts runs (the predict stage), chosen and checked as for training at its
    longest prompt: the Gated-DeltaNet (the chunked rule of the prefill; transformers takes fla's recurrent
    rule for the decode steps itself when fla imports), the fused kernels, the batched vision attention and the
    SDPA backends for padded batches (prompts are left-padded)."""
    return bind(model, before_build(model, device, longest_tokens, None), device, longest_tokens, "auto",
                packed=False, padded=True)


def slow_paths(kernels: dict, device) -> list[str]:
    """Warnings for a GPU run on a slow path nobody asked for: the torch Gated-DeltaNet because fla does not
    import (``VIDEOSFT_GATED_DELTANET=torch`` asks for it, and is not warned about)."""
    gated_deltanet = kernels["gated_deltanet"]
    if device.type != "cuda" or gated_deltanet.get("reason") != "fla does not import":
        return []
    return [slow_path_warning(gated_deltanet["fla"])]


def summary(kernels: dict, device) -> list[str]:
    """The log lines that say what runs: the Gated-DeltaNet, the fused kernels, the vision rotary embedding, and
    on a GPU the autotune table, after any slow path's warning (:func:`slow_paths`), first."""
    fused = {kind: impl for kind, impl in kernels["fused"]["implementation"].items() if impl}
    lines = [*kernels.get("warnings", []),
             f"Gated-DeltaNet: {kernels['gated_deltanet']['implementation']}; fused kernels: {fused}"]
    rotary = kernels.get("vision_rotary")
    if rotary and rotary["implementation"]:
        checked = f", equal to transformers' bit for bit in {len(rotary['checks'])} checks" if rotary["checks"] else ""
        lines.append(f"vision rotary embedding: {rotary['implementation']} "
                     f"({rotary.get('reason', 'one kernel')}{checked})")
    if device.type == "cuda":
        lines.append(autotune.summary(kernels["autotune"]))
    return lines

"""The verify stage's checks of a saved adapter against base + adapter loaded by peft in a fresh process.

Every tensor in the adapter file is compared element-wise and by shape with the one peft loaded
(:func:`compare_adapter`); the adapter is merged module by module, each merged weight checked against
W + scale·B·A up to one rounding (:func:`merged_weights_agree`); and the merged and unmerged models'
logits at the supervised positions of real samples are compared within a tolerance that follows from
the dtype (:func:`forward_agreement`, :func:`forward_tolerance`). :func:`adapter_problems` says which
findings fail the verification.
"""

from __future__ import annotations

from pathlib import Path

from ..data.adapter import ADAPTER_WEIGHTS
from ..errors import UserError
from ..training.batches import collate


class VerificationError(UserError, RuntimeError):
    """An adapter that fails its checks; the message lists every problem."""


def verify_dtype(requested: str):
    """The dtype the model is checked in (``verify.dtype``); ``auto``: bf16 on a GPU (the weights of a 4B
    model then fit a 12 GB card), fp32 on the CPU."""
    import torch

    if requested == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, requested)


def compare_adapter(model, adapter_dir: Path) -> dict:
    """Every saved tensor against the loaded one: shape and every element."""
    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(adapter_dir / ADAPTER_WEIGHTS)
    loaded = get_peft_model_state_dict(model)
    problems = []
    matched = 0
    for key, tensor in sorted(saved.items()):
        if key not in loaded:
            problems.append(f"{key}: in the file, not in the loaded model")
            continue
        ours = loaded[key].detach().cpu()
        if tensor.numel() == 0 or list(tensor.shape) != list(ours.shape):
            problems.append(f"{key}: saved shape {list(tensor.shape)}, loaded {list(ours.shape)}")
        elif not torch.equal(tensor, ours.to(tensor.dtype)):
            difference = (tensor.float() - ours.float()).abs().max().item()
            problems.append(f"{key}: values differ (max |difference| {difference:.3g})")
        else:
            matched += 1
    not_saved = sorted(set(loaded) - set(saved))
    problems += [f"{key}: loaded, but not in the file" for key in not_saved]
    return {"tensors": len(saved), "matched": matched, "summary": f"{matched} of {len(saved)} tensors matched",
            "problems": problems}


# The forward comparison's tolerance, per dtype of the forward: merged and unmerged models compute
# the same function with differently rounded weights (W + s·BA stored once in the dtype, against
# W and the adapter applied beside it), so their logits differ by roundings propagated through the
# layers, at most some units in the last place of the largest logit. Measured on Qwen3.5-4B (logits
# up to 6.2; bench/RESULTS.md): fp32 3.7e-5 = 99 ulp/2, bf16 0.168 = 7 ulp/2. The bounds below give
# about 3x and 2x room over those; a merge that lost or doubled the adapter is off by its whole effect.
UNITS_OF_ROUNDOFF = {"float32": 256, "bfloat16": 16}


def forward_tolerance(dtype, largest_logit: float) -> dict:
    import torch

    name = str(dtype).replace("torch.", "")
    roundoff = torch.finfo(dtype).eps / 2
    units = UNITS_OF_ROUNDOFF.get(name, 16)
    return {"atol": units * roundoff * largest_logit, "dtype": name,
            "reason": f"{units} unit roundoffs of {name} ({roundoff:.3g}) times the largest logit "
                      f"({largest_logit:.3g}): merged and unmerged differ only in how the merged weights were "
                      "rounded, propagated through the layers (measured on Qwen3.5-4B: fp32 about 99, bf16 about "
                      "7 unit roundoffs)"}


def supervised_positions(row: dict) -> list[int]:
    """The positions whose logits the loss reads: one before each supervised label."""
    return [i - 1 for i, label in enumerate(row["labels"]) if label != -100 and i > 0]


def merged_weights_agree(model) -> dict:
    """Merge the adapter module by module, checking each merged weight against W + scale·B·A
    computed in fp32 on the CPU: equal up to one rounding to the weight's dtype (half a unit in the
    last place of each element). One module's weights in fp32 at a time, whatever the model's size."""
    import torch
    from peft.tuners.lora import LoraLayer

    worst, modules, problems = 0.0, 0, []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or not module.active_adapters:
            continue
        weight = module.get_base_layer().weight
        expected = weight.detach().to("cpu", torch.float32, copy=True)  # a copy: the merge changes the weight
        for adapter in module.active_adapters:
            expected += module.get_delta_weight(adapter).detach().float().cpu()
        module.merge()
        merged = weight.detach().float().cpu()
        bound = torch.finfo(weight.dtype).eps / 2 * expected.abs() + torch.finfo(weight.dtype).tiny
        excess = ((merged - expected).abs() - bound).max().item()
        worst = max(worst, (merged - expected).abs().max().item())
        modules += 1
        if excess > 0:
            problems.append(f"{name}: merged weight differs from W + scale·B·A beyond one rounding to {weight.dtype}")
    return {"modules": modules, "max_abs_difference": worst, "ok": not problems, "problems": problems,
            "tolerance": "half a unit in the last place of each merged element (one rounding to the weight dtype)"}


def forward_agreement(model, rows: list[dict], pad_id: int, video_processor) -> dict:
    """Logits of the unmerged and the merged model on the same samples, at the supervised positions
    (full logits of a 248k vocabulary at 13k tokens would not fit a 12 GB card), and each merged
    weight against its definition. Merges the model in place: call it last."""
    import torch

    from ..kernels.gated_deltanet import select_gated_delta_rule

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gated_deltanet = None
    if dtype == torch.float32:
        # fla's kernels multiply fp32 in TF32 (Triton's default dot precision), 2^-11: merged and
        # unmerged then differed by 2.8e-4 on Qwen3.5-4B; transformers' torch path stays in fp32
        gated_deltanet = select_gated_delta_rule(model, device, 0, requested="torch")["implementation"]
    batches = []
    for row in rows:
        batch = {k: v.to(device) for k, v in collate([row], pad_id, video_processor).items() if k != "labels"}
        batch["logits_to_keep"] = torch.tensor(supervised_positions(row), device=device)
        batches.append(batch)
    with torch.no_grad():
        unmerged = [model(**batch, use_cache=False).logits.float().cpu() for batch in batches]
        weights = merged_weights_agree(model)
        merged = [model(**batch, use_cache=False).logits.float().cpu() for batch in batches]
    differences = [(a - b).abs().max().item() for a, b in zip(unmerged, merged)]
    worst = max(differences, default=0.0)
    tolerance = forward_tolerance(dtype, max((logits.abs().max().item() for logits in unmerged), default=0.0))
    return {"samples": len(rows), "max_abs_difference": worst, "tolerance": tolerance,
            "ok": worst <= tolerance["atol"] and weights["ok"], "weights": weights,
            "positions": sum(len(supervised_positions(row)) for row in rows), "gated_deltanet": gated_deltanet,
            "window_ids": [row["window_id"] for row in rows]}


def adapter_problems(adapter_dir: Path, files: dict, tensors: dict, forward: dict) -> list[str]:
    """What fails the verification: tensors that differ from the file, files that are not adapter files
    (``files``: :func:`videosft.data.adapter.adapter_files`), merged weights or logits off their bounds."""
    problems = list(tensors["problems"])
    if files["unexpected_files"]:
        problems.append(f"{adapter_dir} holds files that are not adapter files: {files['unexpected_files']}")
    problems += forward["weights"]["problems"]
    if forward["max_abs_difference"] > forward["tolerance"]["atol"]:
        problems.append(f"merged and unmerged logits differ by {forward['max_abs_difference']:.3g} > "
                        f"{forward['tolerance']['atol']:.3g} ({forward['tolerance']['reason']})")
    return problems

"""Stage 5, verify: reload base + adapter in a fresh process (no DeepSpeed) and check them.

Every tensor in ``adapter_model.safetensors`` is compared element-wise and by shape with the one
``PeftModel.from_pretrained`` loaded; the adapter directory must hold adapter files only. Then
both the base model (adapter disabled) and the fine-tune answer the val windows greedily, and
both are scored with the same parser and metrics (:mod:`videosft.evaluation.answers`), in ``verify.json``
and as a table in the log. Last, the adapter is merged module by module, each merged weight
checked against W + scale·B·A up to one rounding, and the merged and unmerged models' logits at
the supervised positions of real val samples compared within a tolerance that follows from the
dtype (bf16 on a GPU, fp32 on the CPU; ``verify.json`` states it and why). Exits non-zero on any
mismatch.

    python -m videosft.stages.verify --config config.yaml --adapter results/train/adapter \\
        --samples results/preprocess/manifest.json --out results/verify
"""

from __future__ import annotations

import json
import time
from pathlib import Path


from .. import config as config_lib
from ..data.adapter import ADAPTER_WEIGHTS, adapter_files
from ..models.checkpoint import model_class
from ..errors import UserError
from ..evaluation.answers import evaluate
from ..evaluation.answers import table as evaluation_table
from ..provenance import exit_after, run_record, stage_parser, write_json
from ..config import View
from ..data.sample_store import LazySamples, SampleReader, index_samples
from ..training.batches import collate
from ..media.pixels import load_video_processor


class VerificationError(UserError, RuntimeError):
    pass


def verify_dtype(requested: str):
    """bf16 on a GPU (the weights of a 4B model then fit a 12 GB card), fp32 on the CPU."""
    import torch

    if requested == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, requested)


def load_model(model_dir: Path, adapter_dir: Path, dtype=None):
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = model_class(config).from_pretrained(model_dir, dtype=dtype or torch.float32, device_map=device)
    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    return model


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


def verify(cfg: View, adapter_dir: Path, samples_path: Path) -> dict:
    from transformers import AutoTokenizer

    model_dir = Path(cfg.model.path)
    started = time.perf_counter()
    files = adapter_files(adapter_dir)
    model = load_model(model_dir, adapter_dir, verify_dtype(cfg.verify.dtype))
    load_seconds = time.perf_counter() - started
    tensors = compare_adapter(model, adapter_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    video_processor = load_video_processor(model_dir)
    # Every val sample is answered, one at a time: read as it is answered, never all held at once
    reader = SampleReader(index_samples(samples_path, "val"))
    val = LazySamples(reader)
    started = time.perf_counter()
    think_block = json.loads(Path(samples_path).read_text())["think_block"]
    evaluation = evaluate(model, val[: cfg.verify.eval_windows or len(val)], tokenizer, video_processor,
                          cfg.verify.max_new_tokens, think_block)
    evaluation["seconds"] = time.perf_counter() - started
    # merge_and_unload folds the adapter into the base: compared last, once nothing else needs it
    forward = forward_agreement(model, val[: cfg.verify.forward_samples], tokenizer.pad_token_id or 0,
                                video_processor)
    reader.close()
    problems = list(tensors["problems"])
    if files["unexpected_files"]:
        problems.append(f"{adapter_dir} holds files that are not adapter files: {files['unexpected_files']}")
    problems += forward["weights"]["problems"]
    if forward["max_abs_difference"] > forward["tolerance"]["atol"]:
        problems.append(f"merged and unmerged logits differ by {forward['max_abs_difference']:.3g} > "
                        f"{forward['tolerance']['atol']:.3g} ({forward['tolerance']['reason']})")
    return {"adapter": files, "tensors": tensors, "forward": forward, "evaluation": evaluation,
            "load_seconds": load_seconds, "gpu_peak_gib": gpu_peak_gib(), "ok": not problems, "problems": problems}


def gpu_peak_gib() -> dict | None:
    """The most GPU memory this process held (allocated and reserved), or None on the CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {"allocated": torch.cuda.max_memory_allocated() / 2**30, "reserved": torch.cuda.max_memory_reserved() / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--adapter", type=Path, required=True, help="adapter directory from the train stage")
    parser.add_argument("--samples", type=Path, required=True, help="manifest.json from the preprocess stage")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "verify")
    with run_record("verify", args.out, cfg, args) as record:
        result = verify(cfg, args.adapter, args.samples)
        record["results"] = result
        print(f"verify: {result['tensors']['summary']}; adapter {result['adapter']['bytes']:,} bytes; merged vs "
              f"unmerged logits max |difference| {result['forward']['max_abs_difference']:.2e} on "
              f"{result['forward']['samples']} val samples")
        print(f"evaluation on {result['evaluation']['windows']} val windows, greedy, window-local time:")
        print(evaluation_table(result["evaluation"]))
        if not result["ok"]:
            raise VerificationError("adapter verification failed:\n  " + "\n  ".join(result["problems"]))
        write_json(args.out / "verify.json", result)
    return 0


if __name__ == "__main__":
    exit_after(main)

"""Why verify's merged and unmerged logits differ with fla installed (issue 18), one process per dtype.

    python bench/verify_precision.py --model M --manifest preprocess/manifest.json --adapter A \\
        --dtype fp32 --variants torch:tf32off fla:tf32off torch:tf32on fla:tf32on --out r.json

Loads the base as the verify stage does (`videosft.evaluation.inference_model.load_model`: ``from_pretrained`` in
--dtype on the GPU, then ``PeftModel.from_pretrained``), and on the first --samples val samples does what
`evaluation.adapter_checks.forward_agreement` does: full logits of the unmerged model, then of the merged one (here
``merge_adapter``, restored exactly afterwards from saved copies so that the next variant starts from
the same weights). Per variant: the Gated-DeltaNet function transformers' Qwen3.5 modeling calls
(``fla``: what transformers bound when fla imports; ``torch``: its own torch function, found with
``inspect.unwrap``) and TF32 for cuBLAS / cuDNN matrix products (on / off). Reported: max and mean
|unmerged - merged|, the same for two unmerged forwards (determinism), the logits' magnitude, the
difference to the first variant's unmerged logits, and GPU memory (weights, one forward, the whole
comparison with two full logits tensors held).

``--fla-ieee`` sets TRITON_F32_DEFAULT=ieee and fla's solve-tril precision to ieee before fla is
imported, so fla's fp32 matrix products run in full fp32 instead of TF32.
If --adapter does not exist, one is made: LoRA r=8 / alpha 16 on the language model's q_proj and
v_proj (the train stage's defaults) with B drawn N(0, --random-b-std^2) (seed 0), saved there.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code-root", type=Path, default=ROOT, help="where src/videosft is (a snapshot of HEAD)")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--variants", nargs="+", default=["torch:tf32off", "fla:tf32off", "torch:tf32on", "fla:tf32on"])
    parser.add_argument("--fla-ieee", action="store_true")
    parser.add_argument("--random-b-std", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.fla_ieee:
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        os.environ["FLA_TRIL_PRECISION"] = "ieee"
    sys.path.insert(0, str(args.code_root / "src"))
    started = time.time()
    result = {"dtype": args.dtype, "fla_ieee": args.fla_ieee, "variants": [], "argv": sys.argv}

    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoTokenizer

    from videosft.training.batches import collate
    from videosft.media.pixels import load_video_processor
    from videosft.models.checkpoint import model_class
    from videosft.models.lora import target_module_names
    from videosft.data.sample_store import read_samples

    if args.fla_ieee:
        import triton.language as tl

        import fla.ops.gated_delta_rule.chunk_fwd as chunk_fwd

        chunk_fwd.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
    result["imports_seconds"] = time.time() - started
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    GIB = 2**30
    cuda = torch.cuda.is_available()  # CPU only to try the script out: no memory figures there
    where = "cuda" if cuda else "cpu"

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    def allocated():
        return torch.cuda.memory_allocated() if cuda else 0

    def peak():
        return torch.cuda.max_memory_allocated() if cuda else 0

    def load_base():
        config = AutoConfig.from_pretrained(args.model)
        return model_class(config).from_pretrained(args.model, dtype=dtype, device_map=where)

    t = time.time()
    base = load_base()
    if not (args.adapter / "adapter_model.safetensors").exists():
        targets = target_module_names(base, ["q_proj", "v_proj"])
        made = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets))
        generator = torch.Generator().manual_seed(0)
        for name, parameter in made.named_parameters():
            if "lora_B" in name:
                parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * args.random_b_std)
        made.save_pretrained(args.adapter)
        base = made.unload()
        result["adapter_made"] = {"targets": len(targets), "random_b_std": args.random_b_std}
    model = PeftModel.from_pretrained(base, args.adapter)
    model.eval()
    synchronize()
    result["load_seconds"] = time.time() - t
    result["weights_allocated_gib"] = allocated() / GIB
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    result["lora"] = {"tensors": len(lora_b) * 2, "dtype": str(lora_b[0].dtype),
                      "b_abs_max": max(p.detach().abs().max().item() for p in lora_b),
                      "b_abs_mean": sum(p.detach().abs().mean().item() for p in lora_b) / len(lora_b)}
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    originals = [m.get_base_layer().weight.detach().clone() for m in layers]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    video_processor = load_video_processor(args.model)
    rows = read_samples(args.manifest, "val")[: args.samples]
    device = torch.device(where)
    batches = [{k: v.to(device) for k, v in collate([row], tokenizer.pad_token_id or 0, video_processor).items()
                if k != "labels"} for row in rows]
    result["tokens"] = [int(b["input_ids"].shape[1]) for b in batches]
    result["vocab"] = model.config.get_text_config().vocab_size

    bound = modeling.torch_chunk_gated_delta_rule
    torch_function = inspect.unwrap(bound)
    result["transformers_bound"] = f"{getattr(bound, '__module__', '?')}.{getattr(bound, '__qualname__', '?')}"
    result["fla_imported"] = "fla" in sys.modules

    def forward(batch):
        with torch.no_grad():
            return model(**batch, use_cache=False).logits

    reference = None
    for variant in args.variants:
        gdn, tf32 = variant.split(":")
        modeling.torch_chunk_gated_delta_rule = bound if gdn == "fla" else torch_function
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32 == "tf32on"
        row = {"variant": variant, "gdn": gdn, "tf32": tf32 == "tf32on", "per_sample": []}
        for batch in batches:
            synchronize()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            before = allocated()
            t = time.time()
            unmerged = forward(batch)
            synchronize()
            first_seconds = time.time() - t
            one_forward_peak = peak() - before
            t = time.time()
            again = forward(batch)
            synchronize()
            second_seconds = time.time() - t
            repeat = (unmerged.float() - again.float()).abs().max().item()
            del again
            model.merge_adapter()
            merged = forward(batch)
            synchronize()
            comparison_peak = peak() - before
            model.unmerge_adapter()
            with torch.no_grad():
                for layer, weight in zip(layers, originals):
                    layer.get_base_layer().weight.copy_(weight)
            u = unmerged.float()
            difference = (u - merged.float()).abs()
            del merged
            worst_per_token = difference.amax(-1)
            sample = {
                "tokens": int(u.shape[1]), "logits_dtype": str(unmerged.dtype),
                "logits_gib": unmerged.numel() * unmerged.element_size() / GIB,
                "max_abs_difference": difference.max().item(), "mean_abs_difference": difference.mean().item(),
                "worst_token": int(worst_per_token.argmax().item()),
                "tokens_over_1e-4": int((worst_per_token > 1e-4).sum().item()),
                "repeat_max_abs_difference": repeat,
                "logits_abs_max": u.abs().max().item(), "logits_rms": u.pow(2).mean().sqrt().item(),
                "first_forward_seconds": first_seconds, "second_forward_seconds": second_seconds,
                "one_forward_peak_gib": one_forward_peak / GIB, "comparison_peak_gib": comparison_peak / GIB,
            }
            del difference
            if reference is None:
                reference = (variant, u.clone())
            sample["vs_first_variant"] = {"variant": reference[0],
                                          "max_abs_difference": (u - reference[1]).abs().max().item()}
            del u, unmerged
            if cuda:
                torch.cuda.empty_cache()
            row["per_sample"].append(sample)
            print(f"{args.dtype} {variant}: {json.dumps(sample)}", flush=True)
        result["variants"].append(row)
        args.out.write_text(json.dumps(result, indent=2))
    result["seconds"] = time.time() - started
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stage 5, verify: reload base + adapter in a fresh process (no DeepSpeed) and check them.

Every tensor in ``adapter_model.safetensors`` is compared element-wise and by shape with the one
``PeftModel.from_pretrained`` loaded; the adapter directory must hold adapter files only; and the
merged (``merge_and_unload``) and unmerged models must give the same logits on real val samples
within ``verify.forward_atol``. Exits non-zero on any mismatch. Then both the base model (adapter
disabled) and the fine-tune answer the val windows greedily, and both are scored with the same
parser and metrics (R1 at IoU 0.3 / 0.5 / 0.7, mIoU, mAP over IoU 0.5:0.05:0.95, and the rates of
well-formed, unparseable and degenerate answers), in ``verify.json`` and as a table in the log.

    python -m videosft.verify --config config.yaml --adapter results/train/adapter \\
        --samples results/preprocess/manifest.json --out results/verify
"""

from __future__ import annotations

import json
import time
from pathlib import Path


from . import config as config_lib
from .errors import UserError
from .evaluate import evaluate
from .evaluate import table as evaluation_table
from .keymap import model_class
from .preprocess import read_samples
from .provenance import exit_after, run_record, stage_parser, write_json
from .batches import collate
from .train import ADAPTER_FILES, WORKFLOW_MARKERS

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class VerificationError(UserError, RuntimeError):
    pass


def load_model(model_dir: Path, adapter_dir: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = model_class(config).from_pretrained(model_dir, dtype=torch.float32, device_map=device)
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


def adapter_files(adapter_dir: Path) -> dict:
    files = {path.name: path.stat().st_size for path in adapter_dir.iterdir() if path.name not in WORKFLOW_MARKERS}
    extra = sorted(set(files) - ADAPTER_FILES)
    return {"files": files, "bytes": sum(files.values()), "unexpected_files": extra}


def forward_agreement(model, rows: list[dict], pad_id: int, atol: float) -> dict:
    """Largest logit difference between the unmerged and the merged model on the same samples."""
    import torch

    device = next(model.parameters()).device
    batches = [{k: v.to(device) for k, v in collate([row], pad_id).items() if k != "labels"} for row in rows]
    with torch.no_grad():
        unmerged = [model(**batch, use_cache=False).logits for batch in batches]
        merged_model = model.merge_and_unload()
        merged = [merged_model(**batch, use_cache=False).logits for batch in batches]
    differences = [(a - b).abs().max().item() for a, b in zip(unmerged, merged)]
    del merged_model
    worst = max(differences, default=0.0)
    return {"samples": len(rows), "max_abs_difference": worst, "atol": atol, "ok": worst <= atol,
            "window_ids": [row["window_id"] for row in rows]}


def verify(cfg: dict, adapter_dir: Path, samples_path: Path) -> dict:
    from transformers import AutoTokenizer

    model_dir = Path(cfg["model"]["path"])
    started = time.perf_counter()
    files = adapter_files(adapter_dir)
    model = load_model(model_dir, adapter_dir)
    load_seconds = time.perf_counter() - started
    tensors = compare_adapter(model, adapter_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    val = read_samples(samples_path, "val")
    started = time.perf_counter()
    think_block = json.loads(Path(samples_path).read_text())["think_block"]
    evaluation = evaluate(model, val[: cfg["verify"]["eval_windows"] or len(val)], tokenizer,
                          cfg["verify"]["max_new_tokens"], collate, think_block)
    evaluation["seconds"] = time.perf_counter() - started
    # merge_and_unload folds the adapter into the base: compared last, once nothing else needs it
    forward = forward_agreement(model, val[: cfg["verify"]["forward_samples"]], tokenizer.pad_token_id or 0,
                                cfg["verify"]["forward_atol"])
    problems = list(tensors["problems"])
    if files["unexpected_files"]:
        problems.append(f"{adapter_dir} holds files that are not adapter files: {files['unexpected_files']}")
    if not forward["ok"]:
        problems.append(f"merged and unmerged logits differ by {forward['max_abs_difference']:.3g} > {forward['atol']}")
    return {"adapter": files, "tensors": tensors, "forward": forward, "evaluation": evaluation,
            "load_seconds": load_seconds, "ok": not problems, "problems": problems}


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

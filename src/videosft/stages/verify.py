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
from ..config import View
from ..data.adapter import adapter_files
from ..data.sample_store import LazySamples, SampleReader, index_samples
from ..data.verify_result import write_verify
from ..evaluation.adapter_checks import VerificationError, adapter_problems, compare_adapter, forward_agreement, \
    verify_dtype
from ..evaluation.answers import evaluate
from ..evaluation.answers import headline as evaluation_headline
from ..evaluation.answers import table as evaluation_table
from ..evaluation.inference_model import load_model
from ..kernels.gated_deltanet import planned_slow_paths
from ..media.pixels import load_video_processor
from ..provenance import existing_path, exit_after, run_record, stage_parser
from ..training.profiling import gpu_peak_gib


def verify(cfg: View, adapter_dir: Path, samples_path: Path) -> dict:
    """Base + adapter loaded afresh, the adapter checked against its file, base and fine-tune answering
    the val windows, and last the merge checked (it changes the model)."""
    from transformers import AutoTokenizer

    model_dir = Path(cfg.model.path)
    started = time.perf_counter()
    files = adapter_files(adapter_dir)
    model = load_model(model_dir, adapter_dir, verify_dtype(cfg.verify.dtype))
    load_seconds = time.perf_counter() - started
    slow_paths = planned_slow_paths(model)  # the answers would take it: said before they start
    if slow_paths:
        print("\n".join(slow_paths), flush=True)
    tensors = compare_adapter(model, adapter_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    video_processor = load_video_processor(model_dir)
    # Every val sample is answered, verify.batch_size at a time: read as it is answered, never all held at once
    reader = SampleReader(index_samples(samples_path, "val"))
    val = LazySamples(reader)
    started = time.perf_counter()
    think_block = json.loads(Path(samples_path).read_text())["think_block"]
    evaluation = evaluate(model, val[: cfg.verify.eval_windows or len(val)], tokenizer, video_processor,
                          cfg.verify.max_new_tokens, think_block, cfg.verify.batch_size)
    evaluation["seconds"] = time.perf_counter() - started
    # merge_and_unload folds the adapter into the base: compared last, once nothing else needs it
    forward = forward_agreement(model, val[: cfg.verify.forward_samples], tokenizer.pad_token_id or 0,
                                video_processor)
    reader.close()
    problems = adapter_problems(adapter_dir, files, tensors, forward)
    return {"adapter": files, "tensors": tensors, "forward": forward, "evaluation": evaluation,
            "load_seconds": load_seconds, "gpu_peak_gib": gpu_peak_gib(), "warnings": slow_paths, "ok": not problems,
            "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--adapter", type=existing_path, required=True, help="adapter directory from the train stage")
    parser.add_argument("--samples", type=existing_path, required=True, help="manifest.json from the preprocess stage")
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
        write_verify(args.out, result)
        print(f"verify: passed; {evaluation_headline(result['evaluation'])}")
    return 0


if __name__ == "__main__":
    exit_after(main)

"""Stage export: base + adapter merged into one checkpoint that loads anywhere without peft.

The base is loaded in ``export.dtype`` (bf16 by default), the adapter applied and merged
(``merge_and_unload``), and the result saved as sharded safetensors under the base's own key
layout, with the base's processor, tokenizer, chat template and generation files copied;
``from_pretrained`` loads it, and the predict stage takes it as ``model.path`` with
``predict.adapter: null``.

The export holds every tensor of the base: those its transformers class never loads (Qwen3.5's
``mtp.*`` head, which serving engines use for speculative decoding and config.json announces) are
copied through as the base stores them, in the base's dtype, so the checkpoint stays what its
config says. config.json is the base's, except that both ``tie_word_embeddings`` flags (top level,
which transformers ties by, and ``text_config``, which vLLM reads) are set to what the files hold:
true when they hold no ``lm_head.weight``, false when they do (:mod:`videosft.models.merged_checkpoint`).
``export.json`` lists what was merged, what was copied through, what was left out and why, and
the tie flags written.

    python -m videosft.stages.export --config config.yaml --adapter results/train/adapter --out results/export
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..data.adapter import check_readable
from ..errors import InputError
from ..models.checkpoint import companion_files, extras_summary, model_class, read_checkpoint, read_tensors
from ..models.families import family_of
from ..models.merged_checkpoint import (base_only_tensors, check_tie_read_back, differing_tensors, head_is_embedding,
                                        left_out, tie_flags)
from ..provenance import existing_path, exit_after, run_record, stage_parser, write_json


def merge(model_dir: Path, adapter: Path, dtype):
    """The base with the adapter merged into its weights, and what was merged."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig

    cls = model_class(AutoConfig.from_pretrained(model_dir))
    base, loading = cls.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    if loading["missing_keys"]:  # they would be exported as random weights
        missing = sorted(loading["missing_keys"])
        raise InputError(f"{model_dir}: the checkpoint lacks {len(missing)} weights of the model (e.g. {missing[:3]}); "
                         "complete or re-download it (the probe stage lists every key)")
    peft_model = PeftModel.from_pretrained(base, adapter)
    adapted = [name for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)]
    targets = peft_model.peft_config["default"].target_modules
    merged = {"target_modules": targets if isinstance(targets, str) else sorted(targets), "weights": len(adapted),
              "by_module": dict(sorted(Counter(name.rsplit(".", 1)[-1] for name in adapted).items()))}
    return peft_model.merge_and_unload(), merged


def save_with_base_tensors(model, model_dir: Path, out: Path, max_shard_size: str) -> dict:
    """The merged model saved in ``out`` together with the base's tensors the model does not hold,
    copied through unchanged (transformers shards and indexes them with the rest)."""
    base = read_checkpoint(model_dir)
    extras, aliases = base_only_tensors(model, base)
    copied = read_tensors(model_dir, base, extras)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict={**model.state_dict(), **copied}, max_shard_size=max_shard_size)
    written = read_checkpoint(out)
    dropped = left_out(base, written, aliases)
    changed = differing_tensors(out, written, copied)
    if changed:  # a bug (ours or transformers'), not the user's: it keeps its traceback
        raise RuntimeError(f"{out}: {len(changed)} tensors copied from the base were not written as the base "
                           f"stores them (e.g. {changed[:3]}); report this with the transformers version")
    return {"written": written, "copied_tensors": extras_summary(extras, base), "left_out": dropped}


def write_config(model_dir: Path, out: Path, model, written: dict) -> dict:
    """The base's config.json in ``out``, its tie flags set to what the files hold (unchanged when they
    already say it); the rule's record."""
    base_config = json.loads((model_dir / "config.json").read_text())
    lm_head = family_of(base_config).checkpoint.lm_head + "weight"
    config, record = tie_flags(base_config, lm_head in written, head_is_embedding(model))
    if record["config_changed"]:
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        shutil.copy2(model_dir / "config.json", out / "config.json")  # byte for byte, as the base had it
    check_tie_read_back(out, record["config_top"])
    return record


def export(cfg: View, adapter: Path, out: Path) -> dict:
    import torch

    check_readable(adapter)
    model_dir = Path(cfg.model.path)
    model, merged = merge(model_dir, adapter, getattr(torch, cfg.export.dtype))
    saved = save_with_base_tensors(model, model_dir, out, cfg.export.max_shard_size)
    tie = write_config(model_dir, out, model, saved["written"])
    copied = []
    for path in companion_files(model_dir):
        if not (out / path.name).exists() or path.name == "generation_config.json":
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
    files = sorted(path.name for path in out.iterdir() if path.is_file())
    return {"model": str(model_dir), "adapter": str(adapter), "dtype": cfg.export.dtype, "files": files,
            "copied_from_base": copied, "parameters": sum(p.numel() for p in model.parameters()),
            "tensors": len(saved["written"]), "merged": merged, "copied_tensors": saved["copied_tensors"],
            "left_out": saved["left_out"], "tie_word_embeddings": tie}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--adapter", type=existing_path, required=True, help="adapter directory from the train stage")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "export")
    with run_record("export", args.out, cfg, args) as record:
        results = record["results"] = export(cfg, args.adapter, args.out)
        write_json(args.out / "export.json", results)
        copied = results["copied_tensors"]
        print(f"export: {results['parameters']:,} parameters ({cfg.export.dtype}), {results['merged']['weights']} "
              f"weights merged, {copied['count']} base tensors copied through "
              f"({', '.join(f'{prefix}.*' for prefix in copied['by_prefix']) or 'none'}), "
              f"{results['tensors']} tensors in {len(results['files'])} files in {args.out}")
    return 0


if __name__ == "__main__":
    exit_after(main)

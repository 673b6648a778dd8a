"""Stage 3, probe: will this checkpoint load into this model, and what will LoRA touch?

Builds the model on the meta device (no memory, no weights), reads only the safetensors headers,
maps every checkpoint key onto a model parameter with transformers' own conversion rules, and
compares shapes and dtypes. Checks that tokenizer, processor and config agree on the special
tokens and the vocabulary, and reports LoRA coverage per layer type. Exits non-zero with a
readable list on any problem; writes ``probe.json`` with the counts and the key map the trainer
loads with.

    python -m videosft.probe --config config.yaml --out results/probe
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from . import config as config_lib
from .keymap import CheckpointError, build_meta_model, map_checkpoint, read_checkpoint
from .lora import coverage
from .provenance import run_record, stage_parser, write_json


def config_dtype(model) -> str | None:
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else None


def tokenizer_agreement(model_dir: Path, model) -> list[str]:
    """Problems where tokenizer, processor and model config disagree."""
    from transformers import AutoProcessor

    problems = []
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    config = model.config
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_rows:
        problems.append(f"tokenizer has {len(tokenizer)} tokens but the embedding has {embedding_rows} rows")
    for attribute, token in (("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                             ("vision_end_token_id", "<|vision_end|>")):
        in_config = getattr(config, attribute, None)
        in_tokenizer = tokenizer.convert_tokens_to_ids(token)
        if in_config != in_tokenizer:
            problems.append(f"config {attribute}={in_config} but the tokenizer gives {token} id {in_tokenizer}")
    vision = config.vision_config
    video = processor.video_processor
    for attribute, ours in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                            ("spatial_merge_size", "merge_size")):
        if getattr(vision, attribute) != getattr(video, ours):
            problems.append(f"vision config {attribute}={getattr(vision, attribute)} but the video processor "
                            f"has {ours}={getattr(video, ours)}")
    return problems


def probe(cfg: dict) -> dict:
    model_dir = Path(cfg["model"]["path"])
    started = time.perf_counter()
    tensors = read_checkpoint(model_dir)
    model = build_meta_model(model_dir)
    report = map_checkpoint(model, tensors, config_dtype(model))
    agreement = tokenizer_agreement(model_dir, model)
    lora = coverage(model, cfg["lora"]["target_modules"], cfg["lora"]["r"])
    if lora["modules"] == 0:
        agreement.append(f"LoRA targets {cfg['lora']['target_modules']} match no linear module of the language model")
    if lora["missed_layer_types"]:
        print(f"WARNING: LoRA targets {cfg['lora']['target_modules']} miss whole layer types "
              f"{lora['missed_layer_types']} ({lora['layer_type_counts']}); those layers will not adapt. "
              "To cover every layer type, target all linear layers of the language model, e.g. lora.target_modules: "
              "[q_proj, k_proj, v_proj, o_proj, in_proj_qkv, in_proj_z, out_proj, gate_proj, up_proj, down_proj]",
              file=sys.stderr)
    shard_of = {key: info.shard for key, info in tensors.items()}
    return {
        "model_type": model.config.model_type,
        "model_class": type(model).__name__,
        "checkpoint_tensors": len(tensors),
        "model_tensors": len(report.key_map) + len(report.missing),
        "mapped": len(report.key_map),
        "renamed": report.renamed,
        "missing": report.missing,
        "unexpected": report.unexpected,
        "shape_mismatch": report.shape_mismatch,
        "dtype_mismatch": report.dtype_mismatch,
        "agreement_problems": agreement,
        "checkpoint_dtypes": sorted({info.dtype for info in tensors.values()}),
        "config_dtype": config_dtype(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "lora": lora,
        "key_map": {key: {"shard": shard_of[key], "parameter": name} for key, name in report.key_map.items()},
        "seconds": time.perf_counter() - started,
        "ok": report.ok and not agreement,
        "problems": "\n".join(filter(None, [report.problems(), *agreement])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "probe")
    with run_record("probe", args.out, cfg, code=args.code) as record:
        result = probe(cfg)
        record["results"] = {k: v for k, v in result.items() if k != "key_map"}
        lora = result["lora"]
        print(f"probe: {result['model_class']}, {result['mapped']} of {result['checkpoint_tensors']} checkpoint "
              f"tensors mapped ({result['renamed']} renamed), {result['parameters']:,} parameters; LoRA on "
              f"{lora['modules']} modules {lora['modules_per_layer_type']}, "
              f"{lora['trainable_parameters']:,} trainable")
        if not result["ok"]:
            raise CheckpointError(f"checkpoint {cfg['model']['path']} does not fit the model:\n{result['problems']}")
        write_json(args.out / "probe.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

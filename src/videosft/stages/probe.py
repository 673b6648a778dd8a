"""Stage 3, probe: will this checkpoint load into this model, and what will LoRA touch?

Builds the model on the meta device (no memory, no weights), reads only the safetensors headers,
maps every checkpoint key onto a model parameter with transformers' own conversion rules, and
compares shapes and dtypes. Checks that tokenizer, processor and config agree on the special
tokens and the vocabulary, and reports LoRA coverage per layer type. Exits non-zero with a
readable list on any problem; writes ``probe.json`` with the counts and the key map the trainer
loads with.

    python -m videosft.stages.probe --config config.yaml --out results/probe
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from .. import config as config_lib
from ..models.checkpoint import CheckpointError, build_meta_model, extras_summary, map_checkpoint, read_checkpoint
from ..models.lora import coverage
from ..training.memory import SampleFacts, flowchart, largest_frames, micro_batch, model_facts, plan_peak, planned_kernels
from ..provenance import exit_after, run_record, stage_parser, write_json
from ..config import View
from ..data.sample_store import read_samples


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


def longest_sample(manifest: Path) -> SampleFacts:
    """The sample with the most input tokens, in either split: it sets the activation peak."""
    rows = read_samples(manifest, "train", LENGTH_COLUMNS) + read_samples(manifest, "val", LENGTH_COLUMNS)
    row = max(rows, key=lambda r: r["input_tokens"])
    frames = len(row["frame_indices"])
    return SampleFacts(row["input_tokens"], row["visual_tokens"], row["supervised_tokens"], frames,
                       text_per_frame_pair(row["mm_token_type_ids"], frames))


LENGTH_COLUMNS = ["input_tokens", "visual_tokens", "supervised_tokens", "frame_indices", "mm_token_type_ids"]


def text_per_frame_pair(token_types: list[int], frames: int) -> float:
    """Text tokens between consecutive frame pairs' video tokens (a pair's <t seconds> marker and its
    vision start / end tokens): what one more frame pair adds besides its visual tokens."""
    video = [i for i, kind in enumerate(token_types) if kind]
    pairs = frames // 2
    if pairs < 2 or not video:
        return 0.0
    return sum(1 for kind in token_types[video[0]:video[-1] + 1] if not kind) / (pairs - 1)


def memory_plan(model, cfg: View, trainable: int, manifest: Path) -> dict:
    """Predicted per-GPU peaks of the largest micro-batch (``train.micro_batch_size`` longest samples,
    or a pack of ``train.pack_tokens``) for several world sizes, the largest frame count per sample under
    the limit, and the lecture's flowchart (one sample) for the configured world size."""
    ds_zero = json.loads(Path(cfg.train.deepspeed_config).read_text())["zero_optimization"]
    facts = model_facts(model, int(ds_zero.get("stage3_param_persistence_threshold", 1e5)))
    sample = longest_sample(manifest)
    batching = {"micro_batch_size": cfg.train.micro_batch_size, "pack_tokens": cfg.train.pack_tokens or None}
    batch = micro_batch(sample, **batching)
    limit = cfg.memory.gpu_memory_gib
    precision = "bf16" if cfg.train.precision in ("auto", "bf16") else cfg.train.precision
    options = {"checkpointing": cfg.train.gradient_checkpointing,
               "offload_activations": cfg.train.offload_activations,
               "whole_blocks": cfg.train.gather_whole_blocks,
               "kernels": planned_kernels(cfg.train.fused_kernels)}
    per_world = {}
    for world in cfg.memory.world_sizes:
        peak = plan_peak(facts, batch, trainable, world, ds_zero, precision, **options)
        peak["largest_frames_under_limit"] = largest_frames(facts, sample, trainable, world, ds_zero, limit, precision,
                                                            **batching, **options)
        per_world[str(world)] = peak
    return {
        "gpu_memory_gib": limit,
        "precision": precision,
        "longest_sample": dataclasses.asdict(sample),
        "micro_batch": {**batching, **dataclasses.asdict(batch)},
        "model_facts": dataclasses.asdict(facts),
        "per_world_size": per_world,
        "flowchart": flowchart(facts, sample, trainable, max(cfg.memory.world_sizes), ds_zero, limit),
    }


def probe(cfg: View, manifest: Path | None = None) -> dict:
    model_dir = Path(cfg.model.path)
    started = time.perf_counter()
    tensors = read_checkpoint(model_dir)
    model = build_meta_model(model_dir)
    report = map_checkpoint(model, tensors, config_dtype(model))
    agreement = tokenizer_agreement(model_dir, model)
    lora = coverage(model, cfg.lora.target_modules, cfg.lora.r)
    if lora["modules"] == 0:
        agreement.append(f"LoRA targets {cfg.lora.target_modules} match no linear module of the language model")
    if lora["missed_layer_types"]:
        print(f"WARNING: LoRA targets {cfg.lora.target_modules} miss whole layer types "
              f"{lora['missed_layer_types']} ({lora['layer_type_counts']}); those layers will not adapt. "
              "To cover every layer type, set lora.target_modules: [all-linear] (every linear layer of the "
              "language model, not the vision tower or the LM head).",
              file=sys.stderr)
    shard_of = {key: info.shard for key, info in tensors.items()}
    plan = memory_plan(model, cfg, lora["trainable_parameters"], manifest) if manifest else None
    return {
        "model_type": model.config.model_type,
        "model_class": type(model).__name__,
        "checkpoint_tensors": len(tensors),
        "model_tensors": len(report.key_map) + len(report.missing),
        "mapped": len(report.key_map),
        "renamed": report.renamed,
        "missing": report.missing,
        "unexpected": report.unexpected,
        "known_extras": extras_summary(report.ignored, tensors),
        "shape_mismatch": report.shape_mismatch,
        "dtype_mismatch": report.dtype_mismatch,
        "agreement_problems": agreement,
        "checkpoint_dtypes": sorted({info.dtype for info in tensors.values()}),
        "config_dtype": config_dtype(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "lora": lora,
        "memory": plan,
        "key_map": {key: {"shard": shard_of[key], "parameter": name} for key, name in report.key_map.items()},
        "seconds": time.perf_counter() - started,
        "ok": report.ok and not agreement,
        "problems": "\n".join(filter(None, [report.problems(), *agreement])),
    }


def micro_batch_words(plan: dict) -> str:
    batch, longest = plan["micro_batch"], plan["longest_sample"]["input_tokens"]
    if batch["pack_tokens"]:
        return f"a pack of {batch['pack_tokens']} tokens; the longest sample has {longest}"
    if batch["micro_batch_size"] > 1:
        return f"{batch['micro_batch_size']} samples padded to the longest, {longest} tokens"
    return f"the longest sample, {longest} tokens"


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--samples", type=Path, help="manifest.json of the preprocess stage: the memory plan "
                        "is made for its longest sample (no plan without it)")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "probe")
    with run_record("probe", args.out, cfg, args) as record:
        result = probe(cfg, args.samples)
        record["results"] = {k: v for k, v in result.items() if k != "key_map"}
        lora = result["lora"]
        print(f"probe: {result['model_class']}, {result['mapped']} of {result['checkpoint_tensors']} checkpoint "
              f"tensors mapped ({result['renamed']} renamed), {result['parameters']:,} parameters; LoRA on "
              f"{lora['modules']} modules {lora['modules_per_layer_type']}, "
              f"{lora['trainable_parameters']:,} trainable")
        extras = result["known_extras"]
        if extras["count"]:
            print(f"probe: {extras['count']} checkpoint tensors ({extras['bytes'] / 2**20:,.1f} MiB) that "
                  f"{result['model_class']} declares it does not use are left out, as transformers leaves them: "
                  + ", ".join(f"{prefix}.* ({group['count']})" for prefix, group in extras["by_prefix"].items()))
        if result["memory"]:
            plan = result["memory"]
            for world, peak in plan["per_world_size"].items():
                print(f"memory plan, {world} GPU(s): {peak['reserved_gib']:.2f} GiB reserved per GPU "
                      f"({peak['allocated_gib']:.2f} allocated) for the largest micro-batch "
                      f"({micro_batch_words(plan)}); at most "
                      f"{peak['largest_frames_under_limit']} frames per sample fit {plan['gpu_memory_gib']} GiB")
            for step in plan["flowchart"]:
                print(f"  {step['question']} {step['answer']}"
                      + (f" ({step['predicted_gib']:.2f} GiB)" if "predicted_gib" in step else "") + f": {step['why']}")
        if not result["ok"]:
            raise CheckpointError(f"checkpoint {cfg.model.path} does not fit the model:\n{result['problems']}")
        write_json(args.out / "probe.json", result)
    return 0


if __name__ == "__main__":
    exit_after(main)

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

import json
import sys
import time
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..data.probe_result import recorded, write_probe
from ..kernels.gated_deltanet import planned_slow_paths
from ..models.checkpoint import CheckpointError, build_meta_model, config_dtype, extras_summary, map_checkpoint, \
    read_checkpoint, tokenizer_agreement
from ..models.lora import adapted_inputs, coverage
from ..provenance import existing_path, exit_after, run_record, stage_parser
from ..stage_logs import WARNING_START
from ..training.sequence_shards import allowed_sizes
from ..training.memory import CALIBRATED_LORA_TARGETS, AdapterInputs, PlanOptions, longest_sample, micro_batch_words, \
    model_facts, probe_plan


def probe(cfg: View, manifest: Path | None = None) -> dict:
    """The checkpoint's keys mapped onto the model's parameters from the headers alone, the tokenizer's,
    processor's and config's agreement, LoRA's coverage, and the memory plan (with a manifest)."""
    model_dir = Path(cfg.model.path)
    started = time.perf_counter()
    tensors = read_checkpoint(model_dir)
    model = build_meta_model(model_dir)
    report = map_checkpoint(model, tensors, config_dtype(model))
    agreement = tokenizer_agreement(model_dir, model)
    lora = lora_coverage(model, cfg.lora, agreement)
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
        "warnings": planned_slow_paths(model),
        "ok": report.ok and not agreement,
        "problems": "\n".join(filter(None, [report.problems(), *agreement])),
    }


def lora_coverage(model, lora_cfg: View, problems: list[str]) -> dict:
    """LoRA's modules and parameters per layer type; targets that match nothing are a problem, targets
    that miss whole layer types a warning."""
    lora = coverage(model, lora_cfg.target_modules, lora_cfg.r)
    if lora["modules"] == 0:
        problems.append(f"LoRA targets {lora_cfg.target_modules} match no linear module of the language model")
    if lora["missed_layer_types"]:
        print(f"{WARNING_START}LoRA targets {lora_cfg.target_modules} miss whole layer types "
              f"{lora['missed_layer_types']} ({lora['layer_type_counts']}); those layers will not adapt. "
              "To cover every layer type, set lora.target_modules: [all-linear] (every linear layer of the "
              "language model, not the vision tower or the LM head).",
              file=sys.stderr)
    return lora


def memory_plan(model, cfg: View, trainable: int, manifest: Path) -> dict:
    """Predicted per-GPU peaks of the largest micro-batch (``train.micro_batch_size`` longest samples,
    or a pack of ``train.pack_tokens``) for several world sizes, the largest frame count per sample under
    the limit, and the lecture's flowchart (one sample) for the configured world size."""
    ds_zero = json.loads(Path(cfg.train.deepspeed_config).read_text())["zero_optimization"]
    facts = model_facts(model, int(ds_zero.get("stage3_param_persistence_threshold", 1e5)))
    adapters = AdapterInputs(adapted_inputs(model, cfg.lora.target_modules),
                             adapted_inputs(model, CALIBRATED_LORA_TARGETS), cfg.lora.dropout)
    return probe_plan(facts, longest_sample(manifest), trainable, ds_zero, PlanOptions.of(cfg.train),
                      cfg.memory.gpu_memory_gib, cfg.memory.world_sizes, allowed_sizes(model.config.get_text_config()),
                      adapters)


def print_summary(result: dict) -> None:
    """The probe's findings and memory plan, for the log; a slow path the run would take, first."""
    for warning in result["warnings"]:
        print(warning, file=sys.stderr)
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
            shared = f" sharing each micro-batch in groups of {plan['sequence_parallel']}" \
                if plan.get("sequence_parallel", 1) > 1 else ""
            shared += " (without ZeRO: it would partition nothing)" if peak.get("without_zero") else ""
            print(f"memory plan, {world} GPU(s){shared}: {peak['reserved_gib']:.2f} GiB reserved per GPU "
                  f"({peak['allocated_gib']:.2f} allocated) for the largest micro-batch "
                  f"({micro_batch_words(plan)}); at most "
                  f"{peak['largest_frames_under_limit']} frames per sample fit {plan['gpu_memory_gib']} GiB"
                  + lora_copies_words(peak) + uncheckpointed_words(peak))
        for n, peak in plan.get("per_sequence_parallel_size", {}).items():
            if n != "1":
                print(f"memory plan, one micro-batch shared by {n} GPUs (train.sequence_parallel: {n}): "
                      f"{peak['reserved_gib']:.2f} GiB reserved per GPU; at most "
                      f"{peak['largest_frames_under_limit']} frames per sample fit {n} x {plan['gpu_memory_gib']} GiB")
        for step in plan["flowchart"]:
            print(f"  {step['question']} {step['answer']}"
                  + (f" ({step['predicted_gib']:.2f} GiB)" if "predicted_gib" in step else "") + f": {step['why']}")


def lora_copies_words(peak: dict) -> str:
    """The part of the peak that LoRA targets beyond q_proj / v_proj add (memory.adapter_bytes)."""
    copies = peak["components_gib"].get("lora_input_copies", 0.0)
    size = f"{copies:.2f} GiB" if copies >= 0.1 else f"{copies * 1024:.1f} MiB"
    return f"; {size} of it are the LoRA targets' inputs copied for their fp32 adapters" if copies > 0 else ""


def uncheckpointed_words(peak: dict) -> str:
    """What the plan's spare memory could buy back in recomputation (train.uncheckpointed_layers)."""
    most = peak.get("most_uncheckpointed_layers_under_limit")
    if not most:
        return ""
    return (f"; the largest micro-batch leaves room for train.uncheckpointed_layers up to {most} (layers that keep "
            f"their activations instead of recomputing them)")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--samples", type=existing_path, help="manifest.json of the preprocess stage: the memory plan "
                        "is made for its longest sample (no plan without it)")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "probe")
    with run_record("probe", args.out, cfg, args) as record:
        result = probe(cfg, args.samples)
        record["results"] = recorded(result)
        print_summary(result)
        if not result["ok"]:
            raise CheckpointError(f"checkpoint {cfg.model.path} does not fit the model:\n{result['problems']}")
        write_probe(args.out, result)
    return 0


if __name__ == "__main__":
    exit_after(main)

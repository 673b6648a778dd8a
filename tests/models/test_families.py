"""Every model family of the registry (videosft.models.families) through the real stages: window ->
preprocess -> probe -> train (2 CPU ranks, ZeRO-3) -> verify -> predict -> export, on each family's
tiny checkpoint (tests/models/tiny_checkpoints.py), and the run held to what the family's record
says. A family is one record and one tiny-checkpoint builder; this test then covers it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import check_host_positions, run_torchrun, stage_json
from tiny_checkpoints import tiny_checkpoint
from videosft.data.sample_store import read_samples
from videosft.encoding import samples as encoding
from videosft.media.pixels import load_video_processor
from videosft.models.families import FAMILIES, Family
from videosft.stages import export
from videosft.stages import predict
from videosft.stages import preprocess
from videosft.stages import probe
from videosft.stages import verify
from videosft.stages import window
from videosft.training.batches import collate
from vllm_lora_keys import unloadable

STAGES = ("window", "preprocess", "probe", "train", "verify", "predict", "export")
pytestmark = pytest.mark.slow  # every family trains on 2 ranks


def run_stages(model_dir: Path, demo_config: dict, out: Path) -> dict:
    """Every stage on ``model_dir``, as the workflow runs them; each stage's results by name."""
    cfg = {**demo_config, "model": {"path": str(model_dir)}, "train": {**demo_config["train"], "steps": 2},
           "verify": {"eval_windows": 2, "forward_samples": 1}, "predict": {"batch_size": 4, "max_new_tokens": 8},
           "export": {"dtype": "float32"}}
    windows = out / "window" / "windows.parquet"
    assert window.main(["--config", stage_json("window", cfg), "--out", str(out / "window")]) == 0
    shard = out / "preprocess" / "shards" / "0"
    assert preprocess.main(["--config", stage_json("preprocess", cfg), "--windows", str(windows),
                            "--out", str(shard)]) == 0
    assert preprocess.main(["--config", stage_json("preprocess", cfg), "--gather", str(shard),
                            "--out", str(out / "preprocess")]) == 0
    manifest = out / "preprocess" / "manifest.json"
    assert probe.main(["--config", stage_json("probe", cfg), "--samples", str(manifest),
                       "--out", str(out / "probe")]) == 0
    run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples", str(manifest),
                  "--probe", str(out / "probe" / "probe.json"), "--out", str(out / "train")])
    adapter = out / "train" / "adapter"
    assert (adapter / "adapter_model.safetensors").exists()
    assert verify.main(["--config", stage_json("verify", cfg), "--adapter", str(adapter),
                        "--samples", str(manifest), "--out", str(out / "verify")]) == 0
    assert predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter), "--windows", str(windows),
                         "--out", str(out / "predict")]) == 0
    assert export.main(["--config", stage_json("export", cfg), "--adapter", str(adapter),
                        "--out", str(out / "export")]) == 0
    return {stage: json.loads((out / stage / "run_record.json").read_text()).get("results")
            for stage in STAGES}


@pytest.fixture(scope="module")
def runs(demo_dir, demo_config, tmp_path_factory):
    """family name -> (its tiny checkpoint, the directory of its stages' outputs, their results), each
    family run once for all the tests of this file."""
    done: dict[str, tuple[Path, Path, dict]] = {}

    def run(name: str) -> tuple[Path, Path, dict]:
        if name not in done:
            out = tmp_path_factory.mktemp(f"family-{name}")
            model_dir = tiny_checkpoint(name, out / "model", demo_dir)
            done[name] = (model_dir, out, run_stages(model_dir, demo_config, out))
        return done[name]

    return run


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_stage_runs_on_each_family_as_its_record_says(family: Family, runs):
    model_dir, out, results = runs(family.name)
    assert results["probe"]["model_type"] in family.model_types
    assert results["probe"]["model_class"] == family.model_class
    check_training(family, results["train"])
    check_samples(family, model_dir, out)
    check_what_lora_touches(family, model_dir, results["probe"])
    check_adapter_keys_load_in_vllm(out / "train" / "adapter", family)
    tensors = results["verify"]["tensors"]
    assert tensors["summary"] == f"{tensors['matched']} of {tensors['matched']} tensors matched"
    check_predictions(family, results["predict"])
    check_checkpoint_layouts(family, model_dir, out / "export", results["probe"])
    exported = results["export"]  # every base tensor kept, tie flags as the files hold the head
    assert exported["left_out"] == []
    assert exported["copied_tensors"]["count"] == results["probe"]["known_extras"]["count"]
    tie = exported["tie_word_embeddings"]
    assert tie["config_top"] is tie["text_config"] is (not tie["lm_head_in_files"]), tie


def check_training(family: Family, train: dict) -> None:
    """The checkpoint loaded whole, LoRA trained, and the kernels found the layers the record names."""
    assert train["load"]["matched"] == train["load"]["entries"] > 0
    assert train["lora_unchanged_after_two_steps"] == []
    kernels = train["kernels"]
    assert (kernels["gated_deltanet"]["implementation"] is not None) == family.gated_deltanet, kernels["gated_deltanet"]
    found = {kind for kind, implementation in kernels["fused"]["implementation"].items() if implementation}
    assert found == family.fused_kinds, f"the fused kernels found {sorted(found)}; the record says " \
                                        f"{sorted(family.fused_kinds)}"


def check_samples(family: Family, model_dir: Path, out: Path) -> None:
    """Time by the grid or by markers, the layout, the chat turns and the think block, as the record says."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    assert type(processor).__name__ == family.processor_class
    assert encoding.tells_time_by_grid(processor) == family.time_by_grid
    manifest = json.loads((out / "preprocess" / "manifest.json").read_text())
    assert manifest["video_layout"] == family.video_layout("blocks") and manifest["think_block"] == "prompt"
    rows = read_samples(out / "preprocess" / "manifest.json", "train")
    assert rows
    if family.time_by_grid:  # frame pair k at k x second_per_grid_ts: the clip's step (2 frames at 2 fps: 1 s)
        assert all(row["second_per_grid"] == pytest.approx(1.0, abs=0.05) for row in rows)
        assert collate(rows[:2], 0, load_video_processor(model_dir))["second_per_grid_ts"].tolist() == \
            [row["second_per_grid"] for row in rows[:2]]
    else:  # time comes from the <t seconds> markers
        assert all(row["second_per_grid"] is None for row in rows)
        assert "second_per_grid_ts" not in collate(rows[:1], 0, load_video_processor(model_dir))
    tokenizer = processor.tokenizer
    header = family.chat.turn_start + family.chat.assistant_header + (family.chat.empty_think if family.thinking else "")
    for row in rows:  # the empty think block is the prompt's: generation starts where supervision does
        first = next(i for i, label in enumerate(row["labels"]) if label != -100)
        assert tokenizer.decode(row["input_ids"][:first]).endswith(header)
        assert tokenizer.decode(row["input_ids"][first:]) == row["answer"] + family.chat.turn_end + "\n"
    check_host_positions(model_dir, rows[:2])


def check_what_lora_touches(family: Family, model_dir: Path, probe_results: dict) -> None:
    """all-linear adapts, in each layer type, the modules the record names, and never the vision tower."""
    from transformers import AutoConfig

    from videosft.models.checkpoint import build_meta_model
    from videosft.models.lora import target_module_names

    model = build_meta_model(model_dir)
    layer_types = getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "layer_types", None)
    touched: dict[str, set[str]] = {}
    for name in target_module_names(model, ["all-linear"]):
        layer = family.layer_index(name)
        assert layer is not None and not family.in_vision_tower(name), name
        kind = layer_types[layer] if layer_types else family.layer_types[0]
        touched.setdefault(kind, set()).add(name.rsplit(".", 1)[-1])
    assert touched == {kind: set(modules) for kind, modules in family.lora_modules}
    facts = probe_results["memory"]["model_facts"]  # the planner finds the vision tower and the layers by the record
    assert facts["vision_parameters"] > 0 and facts["largest_layer_parameters"] > 0
    assert set(probe_results["lora"]["modules_per_layer_type"]) <= set(family.layer_types)


def check_adapter_keys_load_in_vllm(adapter: Path, family: Family) -> None:
    """Every saved key lands on a language-model layer's linear module under vLLM's mapping, and
    the same keys without `language_model.` (as some advise for vLLM) would not, unless the family's
    mapping has a rule for bare `model.` keys (Qwen2.5-VL's): the check can fail."""
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as handle:
        keys = list(handle.keys())
    assert keys and unloadable(keys, family.name) == []
    stripped = [key.replace("model.language_model.", "model.") for key in keys]
    takes_bare_keys = any(old == "model." for old, _ in family.vllm.prefixes)
    assert unloadable(stripped, family.name) == ([] if takes_bare_keys else stripped)


def check_predictions(family: Family, results: dict) -> None:
    """Every val video predicted, every window answered up to the family's end token."""
    assert results["predicted"] == results["videos"] > 0 and results["windows"] > 0
    for files in results["outputs"].values():
        keep = json.loads((Path(files["otio"]).parent / "keep.json").read_text())
        assert keep["windows"] and all(isinstance(w["answer"], str) and family.generation_end not in w["answer"]
                                       for w in keep["windows"])


def check_checkpoint_layouts(family: Family, model_dir: Path, exported: Path, probe_results: dict) -> None:
    """The tiny checkpoint, and the merged one export writes, are in the family's published key layout,
    and the merged one maps whole onto the model and keeps what the model class skips (Qwen3.5's mtp.*)."""
    from videosft.models.checkpoint import build_meta_model, map_checkpoint, read_checkpoint

    layout = family.checkpoint
    prefixes = (layout.language_model, layout.vision, layout.lm_head, *layout.extras)
    for directory in (model_dir, exported):
        keys = read_checkpoint(directory)
        assert all(key.startswith(prefixes) for key in keys), [k for k in keys if not k.startswith(prefixes)][:5]
        assert any(key.startswith(layout.vision) for key in keys)
        assert any(key.startswith(layout.language_model) and not key.startswith(layout.vision) for key in keys)
    extras = probe_results["known_extras"]
    assert sorted(extras["by_prefix"]) == sorted(prefix.rstrip(".") for prefix in layout.extras)
    report = map_checkpoint(build_meta_model(exported), read_checkpoint(exported))
    base = map_checkpoint(build_meta_model(model_dir), read_checkpoint(model_dir))
    assert report.ok and report.ignored == base.ignored, report.problems()
    assert {key.split(".", 1)[0] for key in report.ignored} == set(extras["by_prefix"])


def test_the_published_checkpoints_are_what_users_download(runs):
    """What only the checkpoints laid out as published have (tests/published.py): Qwen3.5's mtp.*
    tensors, skipped and reported; Qwen3-VL's untied head; the real tokenizers."""
    from transformers import AutoTokenizer

    model_dir, _, results = runs("qwen3_5")
    extras = results["probe"]["known_extras"]
    assert extras["count"] == 6 and list(extras["by_prefix"]) == ["mtp"]
    assert results["train"]["load"]["matched"] == results["train"]["load"]["entries"] == results["probe"]["mapped"]
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 248_077
    model_dir, out, results = runs("qwen3_vl")
    assert results["probe"]["known_extras"]["count"] == 0
    assert results["train"]["load"]["matched"] == results["train"]["load"]["entries"] == results["probe"]["mapped"]
    assert "lm_head.weight" in json.loads((out / "probe" / "probe.json").read_text())["key_map"]  # untied
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 151_669


def test_an_unprofiled_run_profiles_nothing(runs):
    _, out, _ = runs("qwen3_vl")
    assert not list((out / "train").glob("profile.*"))  # train.profile_step unset: nothing profiled


def test_a_frame_rate_a_fixed_step_cannot_follow_is_rejected():
    encoding.check_grid_times(1.0, [0.25, 1.2, 2.3, 3.25])  # within half a step everywhere
    with pytest.raises(encoding.SampleError, match="0.650 s off the fixed step of 1.000 s"):
        encoding.check_grid_times(1.0, [0.25, 1.9, 2.3, 3.25])

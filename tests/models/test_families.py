"""The other model families through the real stages: window -> preprocess -> probe -> train (2 CPU
ranks, ZeRO-3) -> verify, on tiny checkpoints saved by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import check_host_positions, run_torchrun, stage_json
from videosft.encoding import samples as encoding
from videosft.stages import preprocess
from videosft.stages import probe
from videosft.stages import verify
from videosft.stages import window
from videosft.training.batches import collate
from videosft.media.pixels import load_video_processor
from videosft.data.sample_store import read_samples
from vllm_lora_keys import unloadable

pytestmark = pytest.mark.slow  # every family trains on 2 ranks


def run_stages(model_dir: Path, demo_config: dict, out: Path) -> dict:
    cfg = {**demo_config, "model": {"path": str(model_dir)}, "train": {**demo_config["train"], "steps": 2},
           "verify": {"eval_windows": 2, "forward_samples": 1}}
    assert window.main(["--config", stage_json("window", cfg), "--out", str(out / "window")]) == 0
    shard = out / "preprocess" / "shards" / "0"
    assert preprocess.main(["--config", stage_json("preprocess", cfg), "--windows", str(out / "window" / "windows.parquet"),
                            "--out", str(shard)]) == 0
    assert preprocess.main(["--config", stage_json("preprocess", cfg), "--gather", str(shard),
                            "--out", str(out / "preprocess")]) == 0
    manifest = out / "preprocess" / "manifest.json"
    assert probe.main(["--config", stage_json("probe", cfg), "--samples", str(manifest),
                       "--out", str(out / "probe")]) == 0
    run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples", str(manifest),
                  "--probe", str(out / "probe" / "probe.json"), "--out", str(out / "train")])
    assert (out / "train" / "adapter" / "adapter_model.safetensors").exists()
    assert verify.main(["--config", stage_json("verify", cfg), "--adapter", str(out / "train" / "adapter"),
                        "--samples", str(manifest), "--out", str(out / "verify")]) == 0
    results = {stage: json.loads((out / stage / "run_record.json").read_text())["results"]
               for stage in ("probe", "train", "verify")}
    check_adapter_keys_load_in_vllm(out / "train" / "adapter", results["probe"]["model_type"])
    return results


def check_adapter_keys_load_in_vllm(adapter: Path, family: str) -> None:
    """Every saved key lands on a language-model layer's linear module under vLLM's mapping, and
    the same keys without `language_model.` (as some advise for vLLM) would not: the check can fail."""
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as handle:
        keys = list(handle.keys())
    assert keys and unloadable(keys, family) == []
    stripped = [key.replace("model.language_model.", "model.") for key in keys]
    assert unloadable(stripped, family) == ([] if family == "qwen2_5_vl" else stripped)


def test_qwen3_vl_trains_and_verifies(qwen3vl_dir, demo_config, tmp_path):
    results = run_stages(qwen3vl_dir, demo_config, tmp_path)
    assert results["probe"]["model_type"] == "qwen3_vl"
    train = results["train"]
    assert train["load"]["matched"] == train["load"]["entries"] > 0
    assert train["lora_unchanged_after_two_steps"] == []
    assert train["kernels"]["gated_deltanet"]["implementation"] is None  # no linear-attention layers
    assert not list((tmp_path / "train").glob("profile.*"))  # train.profile_step unset: nothing profiled
    tensors = results["verify"]["tensors"]
    assert tensors["summary"] == f"{tensors['matched']} of {tensors['matched']} tensors matched"
    rows = read_samples(tmp_path / "preprocess" / "manifest.json", "train")
    assert all(row["second_per_grid"] is None for row in rows)  # time comes from the <t seconds> markers
    assert "second_per_grid_ts" not in collate(rows[:1], 0, load_video_processor(qwen3vl_dir))
    check_host_positions(qwen3vl_dir, rows[:2])


def test_qwen2_5_vl_trains_and_verifies_with_its_time_step(qwen25_dir, demo_config, tmp_path):
    """Qwen2.5-VL has no <t seconds> markers: it places frame pair k at k x second_per_grid_ts in its
    M-RoPE positions. The step must be the clip's (two frames at 2 fps: 1 s), and reach the model."""
    results = run_stages(qwen25_dir, demo_config, tmp_path)
    assert results["probe"]["model_type"] == "qwen2_5_vl"
    train = results["train"]
    assert train["load"]["matched"] == train["load"]["entries"] > 0
    assert train["lora_unchanged_after_two_steps"] == []
    tensors = results["verify"]["tensors"]
    assert tensors["summary"] == f"{tensors['matched']} of {tensors['matched']} tensors matched"
    rows = read_samples(tmp_path / "preprocess" / "manifest.json", "train")
    assert all(row["second_per_grid"] == pytest.approx(1.0, abs=0.05) for row in rows)
    assert collate(rows[:2], 0, load_video_processor(qwen25_dir))["second_per_grid_ts"].tolist() == [row["second_per_grid"] for row in rows[:2]]
    check_host_positions(qwen25_dir, rows[:2])


def test_a_frame_rate_a_fixed_step_cannot_follow_is_rejected():
    encoding.check_grid_times(1.0, [0.25, 1.2, 2.3, 3.25])  # within half a step everywhere
    with pytest.raises(encoding.SampleError, match="0.650 s off the fixed step of 1.000 s"):
        encoding.check_grid_times(1.0, [0.25, 1.9, 2.3, 3.25])


def test_a_checkpoint_as_published_goes_through_every_stage_with_its_own_template(published_qwen35, demo_config,
                                                                                    tmp_path):
    """Qwen3.5 as users download it (tests/published.py): mtp.* tensors in a shard of their own,
    hub-style processor files, the real 248k tokenizer and a hybrid-thinking chat template, with no
    code or config change beyond model.path."""
    from transformers import AutoTokenizer

    results = run_stages(published_qwen35, demo_config, tmp_path)
    extras = results["probe"]["known_extras"]
    assert results["probe"]["model_type"] == "qwen3_5" and extras["count"] == 6 and list(extras["by_prefix"]) == ["mtp"]
    train = results["train"]
    assert train["load"]["matched"] == train["load"]["entries"] == results["probe"]["mapped"]
    assert train["lora_unchanged_after_two_steps"] == []
    tensors = results["verify"]["tensors"]
    assert tensors["summary"] == f"{tensors['matched']} of {tensors['matched']} tensors matched"
    manifest = json.loads((tmp_path / "preprocess" / "manifest.json").read_text())
    assert manifest["video_layout"] == "blocks" and manifest["think_block"] == "prompt"
    tokenizer = AutoTokenizer.from_pretrained(published_qwen35)
    assert len(tokenizer) == 248_077
    rows = read_samples(tmp_path / "preprocess" / "manifest.json", "train")
    for row in rows:  # the empty think block is the prompt's: generation starts where supervision does
        first = next(i for i, label in enumerate(row["labels"]) if label != -100)
        assert tokenizer.decode(row["input_ids"][:first]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert tokenizer.decode(row["input_ids"][first:]) == row["answer"] + "<|im_end|>\n"


def test_a_qwen3_vl_checkpoint_as_published_goes_through_every_stage(published_qwen3vl, demo_config, tmp_path):
    """Qwen3-VL as users download it: shards with an untied head and deepstack mergers, hub-style
    processor files with chat_template.json, the real 151k tokenizer."""
    from transformers import AutoTokenizer

    results = run_stages(published_qwen3vl, demo_config, tmp_path)
    assert results["probe"]["model_type"] == "qwen3_vl" and results["probe"]["known_extras"]["count"] == 0
    assert results["train"]["load"]["matched"] == results["train"]["load"]["entries"] == results["probe"]["mapped"]
    assert "lm_head.weight" in json.loads((tmp_path / "probe" / "probe.json").read_text())["key_map"]  # untied
    tensors = results["verify"]["tensors"]
    assert tensors["summary"] == f"{tensors['matched']} of {tensors['matched']} tensors matched"
    tokenizer = AutoTokenizer.from_pretrained(published_qwen3vl)
    rows = read_samples(tmp_path / "preprocess" / "manifest.json", "train")
    assert len(tokenizer) == 151_669 and rows
    for row in rows:  # no think block in this template: supervision starts right after the assistant header
        first = next(i for i, label in enumerate(row["labels"]) if label != -100)
        assert tokenizer.decode(row["input_ids"][:first]).endswith("<|im_start|>assistant\n")

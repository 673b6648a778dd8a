"""The other model families through the real stages: window -> preprocess -> probe -> train (2 CPU
ranks, ZeRO-3) -> verify, on tiny checkpoints saved by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import check_host_positions, run_torchrun, stage_json
from videosft import preprocess, probe, verify, window
from videosft.batches import collate


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
    result = run_torchrun(["-m", "videosft.train", "--config", stage_json("train", cfg), "--samples", str(manifest),
                           "--probe", str(out / "probe" / "probe.json"), "--out", str(out / "train")])
    assert (out / "train" / "adapter" / "adapter_model.safetensors").exists()
    assert verify.main(["--config", stage_json("verify", cfg), "--adapter", str(out / "train" / "adapter"),
                        "--samples", str(manifest), "--out", str(out / "verify")]) == 0
    return {stage: json.loads((out / stage / "run_record.json").read_text())["results"]
            for stage in ("probe", "train", "verify")}


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
    rows = preprocess.read_samples(tmp_path / "preprocess" / "manifest.json", "train")
    assert all(row["second_per_grid"] is None for row in rows)  # time comes from the <t seconds> markers
    assert "second_per_grid_ts" not in collate(rows[:1], 0)
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
    rows = preprocess.read_samples(tmp_path / "preprocess" / "manifest.json", "train")
    assert all(row["second_per_grid"] == pytest.approx(1.0, abs=0.05) for row in rows)
    assert collate(rows[:2], 0)["second_per_grid_ts"].tolist() == [row["second_per_grid"] for row in rows[:2]]
    check_host_positions(qwen25_dir, rows[:2])


def test_a_frame_rate_a_fixed_step_cannot_follow_is_rejected():
    preprocess.check_grid_times(1.0, [0.25, 1.2, 2.3, 3.25])  # within half a step everywhere
    with pytest.raises(preprocess.SampleError, match="0.650 s off the fixed step of 1.000 s"):
        preprocess.check_grid_times(1.0, [0.25, 1.9, 2.3, 3.25])

"""bench/one_rank_zero3.py keeps the model config's blocks at tiny widths and times a step's parts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import one_rank_zero3  # noqa: E402

CONFIG = ROOT / "bench" / "configs" / "Qwen3.5-4B.json"


def test_the_tiny_model_has_the_published_blocks_and_the_sample_its_video():
    real = json.loads(CONFIG.read_text())
    tiny = one_rank_zero3.tiny_config(real)
    assert tiny.text_config.layer_types == real["text_config"]["layer_types"]  # 24 linear, 8 full attention
    assert tiny.vision_config.depth == real["vision_config"]["depth"] and tiny.text_config.hidden_size == 64
    batch = one_rank_zero3.sample()
    video_tokens = int((batch["input_ids"] == tiny.video_token_id).sum())
    pairs, height, width = batch["video_grid_thw"][0].tolist()
    assert video_tokens == pairs * height * width // 4 == int((batch["mm_token_type_ids"] == 2).sum())
    assert batch["pixel_values_videos"].shape[0] == pairs * height * width


def test_a_plain_run_times_every_part_of_its_steps():
    result = one_rank_zero3.run("plain", CONFIG, steps=3)
    assert result["mode"] == "plain" and result["tokens"] == 216 and result["lora_tensors"] > 0
    parts = result["forward"] + result["backward"] + result["optimizer"]
    assert all(result[key] > 0 for key in ("forward", "backward", "optimizer"))
    assert 0.5 * result["step_s"] < parts < 1.5 * result["step_s"]  # medians of parts, beside the steps' median


@pytest.mark.slow  # two processes, ~20 s
def test_the_deepspeed_modes_run_the_train_stages_two_one_rank_setups():
    """stage0 is the train stage's one-rank run (DeepSpeed without ZeRO, the stage's clipping optimizer),
    zero3 its run under train.zero3_on_one_rank: each in a process of its own, one gloo rank."""
    runs = {mode: one_rank_zero3.in_process(mode, CONFIG, steps=3) for mode in ("stage0", "zero3")}
    assert {mode: run["zero_stage"] for mode, run in runs.items()} == {"stage0": 0, "zero3": 3}
    assert all(run["step_s"] > 0 and run["lora_tensors"] == runs["stage0"]["lora_tensors"] for run in runs.values())

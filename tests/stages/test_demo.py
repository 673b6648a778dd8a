"""The demo's pretraining of the tiny base: what it teaches, and that it never teaches the answer format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from videosft import config as config_lib
from videosft.encoding.chat import IGNORE_INDEX, parse_answer, prompt_timestamps
from videosft.synthetic import pretraining


@pytest.fixture(scope="module")
def processor(demo_dir):
    return AutoProcessor.from_pretrained(demo_dir / "model")


def demo_cfg(**pretrain) -> config_lib.View:
    return config_lib.section("demo", {"pretrain": pretrain})


def test_a_pretraining_answer_lists_the_marked_times_of_the_pairs_with_the_ball(processor):
    rng = np.random.default_rng(3)
    cfg = demo_cfg()
    answers = []
    for _ in range(12):
        sample = pretraining.pretraining_sample(rng, cfg, processor, "system line")
        tokenizer = processor.tokenizer
        prompt = tokenizer.decode(sample["input_ids"][: sample["prompt_length"]])
        markers = prompt_timestamps(prompt)
        assert len(markers) == 8 and markers[0] < 0.5  # 8 s at 2 frames per second, in pairs
        listed = [] if sample["answer"] == pretraining.NEVER else [float(t) for t in sample["answer"].split(", ")]
        assert set(listed) <= set(markers)
        # the labels supervise the answer and its end token only
        supervised = sample["labels"] != IGNORE_INDEX
        assert tokenizer.decode(sample["input_ids"][supervised]) == sample["answer"] + "<|im_end|>"
        # never an answer the range format parses: the base must score zero on the pipeline's task
        assert parse_answer(sample["answer"]) is None
        answers.append(sample["answer"])
    assert pretraining.NEVER in answers and any("," in a for a in answers)


def test_the_ball_is_in_exactly_the_listed_pairs(processor):
    sample = pretraining.pretraining_sample(np.random.default_rng(5), demo_cfg(), processor, "")
    t, h, w = sample["video_grid_thw"][0].tolist()
    pixels = sample["pixel_values_videos"].reshape(t, h * w, 3, 2, 16, 16)
    red = (pixels[:, :, 0] - pixels[:, :, 1]).amax(dim=(1, 2, 3, 4))  # ball: 1.6 after normalisation, background <= 0
    markers = prompt_timestamps(processor.tokenizer.decode(sample["input_ids"][: sample["prompt_length"]]))
    listed = set() if sample["answer"] == pretraining.NEVER else {float(x) for x in sample["answer"].split(", ")}
    assert 0 < len(listed) < len(markers)
    assert [bool(v > 1.0) for v in red] == [m in listed for m in markers]


@pytest.mark.slow  # a demo stage with pretraining: about 20 s
def test_a_pretraining_that_did_not_take_fails_the_demo_stage(processor, demo_dir):
    model = AutoModelForImageTextToText.from_pretrained(demo_dir / "model", dtype=torch.float32)
    cfg = demo_cfg(steps=2, clips=10, held_out=4, min_exact_match=1.0)
    with pytest.raises(RuntimeError, match="raise demo.pretrain.steps"):
        pretraining.pretrain(model, processor, cfg, "system line")


def test_the_demo_checkpoints_tie_flags_agree_with_its_files(demo_dir):
    """Tied at the top level (transformers) and in the text config (vLLM), and no lm_head.weight in the files."""
    import json

    from videosft.models.checkpoint import read_checkpoint

    config = json.loads((demo_dir / "model" / "config.json").read_text())
    assert "lm_head.weight" not in read_checkpoint(demo_dir / "model")
    assert config["tie_word_embeddings"] is config["text_config"]["tie_word_embeddings"] is True

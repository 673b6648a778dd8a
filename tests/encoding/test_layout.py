"""Golden tokens: the ids preprocess gives the model for a fixed clip equal ids written out from the
layout rules (src/videosft/layout.py, docs/video-layout.md), not from the installed processor's
expansion, for each family; so a transformers upgrade that expands otherwise fails here instead of
silently changing the training data."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoProcessor

from videosft import config as config_lib
from videosft.encoding import layout
from videosft.encoding.chat import messages, render_answer
from videosft.encoding.samples import build_sample, processor_geometry
from videosft.media.budget import resolve_budget
from videosft.media.video import VideoFile


def first_window(prepared: Path) -> dict:
    return pq.read_table(prepared / "window" / "windows.parquet").to_pylist()[0]


def sample_for(model_dir: Path, demo_config: dict, prepared: Path, video_layout: str = "blocks") -> tuple[dict, object]:
    cfg = config_lib.for_stage("preprocess", {**demo_config, "model": {"path": str(model_dir)},
                                              "prompt": {"video_layout": video_layout}})
    processor = AutoProcessor.from_pretrained(model_dir)
    window = first_window(prepared)
    video = VideoFile(Path(cfg.data.root) / window["video"])
    sample = build_sample(window, video, processor, cfg, resolve_budget(cfg.video), processor_geometry(processor))
    return sample, processor


def ids_by_the_rules(sample: dict, processor, cfg_prompt: dict, video_layout: str) -> list[int]:
    """The chat template's text around its one video placeholder, tokenized, with the video written
    out by the layout rules: per frame pair ``<t seconds>`` (the mean of the pair's two frame times
    in window seconds, to one decimal) then <|vision_start|>, its tokens, <|vision_end|>."""
    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(messages(cfg_prompt, sample["query"], render_answer(sample["keep_local"])),
                                         tokenize=False, enable_thinking=False)
    before, after = text.split(layout.PLACEHOLDER)
    start, pad, end = (tokenizer.convert_tokens_to_ids(t) for t in (layout.VIDEO_START, layout.VIDEO_PAD, layout.VIDEO_END))
    pairs, height, width = sample["video_grid_thw"]
    per_pair = height * width // 4
    encode = lambda piece: tokenizer(piece, add_special_tokens=False)["input_ids"]  # noqa: E731
    if video_layout == "single":
        video = [start] + [pad] * per_pair * pairs + [end]
    else:
        times = [round(t * 1000) / 1000 for t in sample["frame_times"]]
        video = []
        for k in range(pairs):
            video += encode(f"<{(times[2 * k] + times[2 * k + 1]) / 2:.1f} seconds>") + [start] + [pad] * per_pair + [end]
        if video_layout == "nested":
            video = [start] + video + [end]
    return encode(before) + video + encode(after)


@pytest.mark.parametrize("family, video_layout", [("qwen3_5", "blocks"), ("qwen3_5", "nested"),
                                                  ("qwen3_vl", "blocks"), ("qwen3_vl", "nested"),
                                                  ("qwen2_5_vl", "blocks"), ("published_qwen3_5", "blocks"),
                                                  ("published_qwen3_vl", "blocks")])
def test_preprocess_writes_the_layout_token_for_token(family, video_layout, demo_dir, qwen3vl_dir, qwen25_dir,
                                                      demo_config, prepared, request):
    """published_*: the real tokenizers (248k for Qwen3.5, 151k for Qwen3-VL) and hub-style templates
    (tests/published.py)."""
    model_dir = {"qwen3_5": demo_dir / "model", "qwen3_vl": qwen3vl_dir, "qwen2_5_vl": qwen25_dir}.get(family) \
        or request.getfixturevalue({"published_qwen3_5": "published_qwen35", "published_qwen3_vl": "published_qwen3vl"}[family])
    sample, processor = sample_for(model_dir, demo_config, prepared, video_layout)
    prompt = config_lib.section("prompt")
    expected_layout = "single" if family == "qwen2_5_vl" else video_layout
    assert sample["input_ids"] == ids_by_the_rules(sample, processor, prompt, expected_layout)
    starts = sample["input_ids"].count(processor.tokenizer.convert_tokens_to_ids(layout.VIDEO_START))
    pairs = sample["video_grid_thw"][0]
    assert starts == {"blocks": pairs, "nested": pairs + 1, "single": 1}[expected_layout]


def test_a_layout_the_rules_do_not_allow_is_named(demo_dir, demo_config, prepared):
    sample, processor = sample_for(demo_dir / "model", demo_config, prepared)
    tokenizer = processor.tokenizer
    tokens = layout.VideoTokens.of(tokenizer)
    pairs, height, width = sample["video_grid_thw"]
    per_pair = [height * width // 4] * pairs
    ids = sample["input_ids"]
    layout.check_layout(ids, tokens, tokenizer.decode, "blocks", per_pair)
    with pytest.raises(layout.LayoutError, match="3 <|vision_start|>|expected"):
        layout.check_layout(ids, tokens, tokenizer.decode, "nested", per_pair)
    first = ids.index(tokens.start)
    marker = layout._marker_begin(ids, first, tokenizer.decode)
    wrapped = ids[:marker] + [tokens.start] + ids[marker:]
    last_end = max(i for i, token in enumerate(wrapped) if token == tokens.end)
    wrapped = wrapped[:last_end + 1] + [tokens.end] + wrapped[last_end + 1:]
    layout.check_layout(wrapped, tokens, tokenizer.decode, "nested", per_pair)  # transformers 5.x's expansion
    with pytest.raises(layout.LayoutError, match="vision start|expected"):
        layout.check_layout(wrapped, tokens, tokenizer.decode, "blocks", per_pair)
    no_marker = ids[:marker] + ids[first:]
    with pytest.raises(layout.LayoutError, match="frame pair 0: .* not one '<t seconds>' marker"):
        layout.check_layout(no_marker, tokens, tokenizer.decode, "blocks", per_pair)
    short = ids[:first + 1] + ids[first + 2:]
    with pytest.raises(layout.LayoutError, match="video tokens in the prompt"):
        layout.check_layout(short, tokens, tokenizer.decode, "blocks", per_pair)

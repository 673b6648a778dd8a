"""The stored frames: the model receives exactly the processor's pixels, from a fraction of the bytes."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoProcessor

from videosft import config as config_lib
from videosft.encoding import samples as encoding
from videosft.data import sample_store
from videosft.media.budget import resolve_budget
from videosft.media.pixels import frames_of, load_video_processor, pixel_values_videos, stored_bytes
from videosft.media.video import VideoFile

FAMILIES = ["qwen3_5", "qwen3_vl", "qwen2_5_vl"]


@pytest.fixture(params=FAMILIES)
def model_dir(request, demo_dir) -> Path:
    return {"qwen3_5": lambda: demo_dir / "model", "qwen3_vl": lambda: request.getfixturevalue("qwen3vl_dir"),
            "qwen2_5_vl": lambda: request.getfixturevalue("qwen25_dir")}[request.param]()


def test_the_model_receives_the_processors_pixels_from_a_quarter_of_the_bytes(model_dir, demo_dir, tmp_path):
    processor = AutoProcessor.from_pretrained(model_dir)
    cfg = config_lib.for_stage("preprocess", {"video": {"max_tokens": 64}})
    budget, geometry = resolve_budget(cfg.video, environ={}), encoding.processor_geometry(processor)
    window = {"window_id": "w0", "split": "train", "video": "video_000.mp4", "query": "the red ball",
              "window_start": 2.0, "window_end": 10.0, "keep_local": [[2.0, 3.0]]}
    video = VideoFile(demo_dir / "videos" / window["video"])
    sample = encoding.build_sample(window, video, processor, cfg, budget, geometry)  # runs the budget and grid checks
    writer = sample_store.ShardWriter(tmp_path, {"schema_version": sample_store.SCHEMA_VERSION}, 2**30)
    writer.add(sample)
    writer.close()
    (row,) = pq.read_table(tmp_path / "train-00000.parquet").to_pylist()

    clip = video.clip(window["window_start"], window["window_end"], budget, **geometry)
    assert torch.equal(frames_of(row), clip.frames)
    made = encoding.encode(processor, clip, "<|vision_start|><|video_pad|><|vision_end|>")
    rebuilt = pixel_values_videos(row, load_video_processor(model_dir))
    assert rebuilt.dtype == torch.float16 and rebuilt.shape[0] == made["video_grid_thw"][0].prod()
    assert torch.equal(rebuilt, made["pixel_values_videos"].half())  # as the float16 store held them before
    float16_patches = 2 * made["pixel_values_videos"].numel()
    assert stored_bytes(row) * 4 <= float16_patches, (stored_bytes(row), float16_patches)


"""The GPU benches' samples (bench/gpu_pipeline.py's builder, which train_throughput and perf_guard
use) are made by the preprocess stage's code on CPU too: a change to that code that the builder
does not follow fails here, not in a paid GPU call."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_pipeline import build_samples  # noqa: E402
from videosft.data.sample_store import read_samples  # noqa: E402
from videosft.media.pixels import frames_of  # noqa: E402


def test_the_builder_writes_a_store_the_train_stage_reads(demo_dir, tmp_path):
    cfg = {"model": {"path": str(demo_dir / "model")}, "video": {"max_frames": 4, "max_tokens": 4}}
    facts = build_samples(cfg, tmp_path, 3, 4.0, 2)
    train, val = read_samples(tmp_path / "manifest.json", "train"), read_samples(tmp_path / "manifest.json", "val")
    assert (len(train), len(val)) == (2, 1) and facts["frames"] == (4, 4)
    for row in train + val:
        assert frames_of(row).shape[0] == len(row["frame_times"]) == 4
        assert row["decoding"] == "synthetic frames" and len(row["keep_local"]) == 2

"""Each train rank holds the index of the split and the rows of the batches at hand, never the split:
its peak host memory does not grow with the number of windows (issue #20)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from conftest import run_torchrun, stage_json
from videosft.data import sample_store
from videosft.media.pixels import WEBP

# A demo sample's frames weigh about 80 KB; a real 128-frame window about 18 MB. Each frame image
# here carries an EXIF chunk of random bytes (the decoder ignores it, so the pixels, the batches and
# the steps are the demo's) that makes a sample weigh PADDED_SAMPLE_BYTES. A CPU train rank peaks
# near 1 GiB; the store of 10x the samples holds 72 samples x 2.5 MB = 180 MB more frames, 17% of a
# rank before pyarrow's table and the Python rows that a rank loading the split whole holds at once
# (as the train stage did before the index: measured +32%, 1.05 -> 1.39 GiB, on 2 cores). The 10%
# bound thus fails for such a rank by a wide margin and holds for one that reads its batches only
# (each rank then holds one row group of 8 samples, 20 MB, whatever the store's size).
PADDED_SAMPLE_BYTES = 2_500_000
SCALE = 10


def padded_frames(frames: list[bytes], rng) -> list[bytes]:
    padding = PADDED_SAMPLE_BYTES // len(frames)
    padded = []
    for image in frames:
        buffer = io.BytesIO()
        Image.open(io.BytesIO(image)).save(buffer, **WEBP, exif=b"Exif\x00\x00" + rng.bytes(padding))
        padded.append(buffer.getvalue())
    return padded


def write_store(prepared: Path, out: Path, copies: int) -> Path:
    """The demo's train split with heavy frames, each sample ``copies`` times under new window ids;
    written as the preprocess stage writes it (ShardWriter, manifest)."""
    import numpy as np

    manifest = prepared / "preprocess" / "manifest.json"
    source = json.loads(manifest.read_text())
    metadata = sample_store.read_metadata(sample_store.sample_files(manifest, "train")[0])
    out.mkdir()
    writer = sample_store.ShardWriter(out, metadata, max_bytes=64 * 2**20)
    rng = np.random.default_rng(0)
    rows = [{**row, "frames": padded_frames(row["frames"], rng)} for row in sample_store.read_samples(manifest, "train")]
    for copy in range(copies):
        for row in rows:
            writer.add({**row, "window_id": f"{row['window_id']}+{copy:02d}"})
    files = writer.close()
    sample_store.write_manifest(out, files, {"train": len(rows) * copies}, source["budget"], source["geometry"],
                                source["video_layout"], source["think_block"])
    return out / sample_store.MANIFEST


def peak_rss_gib(out: Path, rank: int) -> float:
    steps = [json.loads(line) for line in (out / f"steps.rank{rank}.jsonl").read_text().splitlines()]
    return max(step["peak_rss_gib"] for step in steps)


@pytest.mark.slow
def test_a_rank_peak_host_memory_does_not_grow_with_the_store(prepared, demo_config, tmp_path):
    cfg = {**demo_config, "train": {**demo_config["train"], "steps": 2, "timeout_s": 120}}
    peaks = {}
    for copies in (1, SCALE):
        samples = write_store(prepared, tmp_path / f"store{copies}", copies)
        out = tmp_path / f"train{copies}"
        run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples", str(samples),
                      "--probe", str(prepared / "probe" / "probe.json"), "--out", str(out)], timeout=600)
        record = json.loads((out / "run_record.json").read_text())
        assert record["status"] == "ok" and record["results"]["samples"] == 8 * copies
        peaks[copies] = [peak_rss_gib(out, rank) for rank in (0, 1)]
    stored = sum(os.path.getsize(path) for path in (tmp_path / f"store{SCALE}").glob("train-*.parquet"))
    assert stored > 8 * SCALE * PADDED_SAMPLE_BYTES * 0.9  # the frames are as heavy as meant
    for rank in (0, 1):
        small, large = peaks[1][rank], peaks[SCALE][rank]
        assert large <= small * 1.10, (f"rank {rank}: peak RSS {large:.3f} GiB on {8 * SCALE} samples against "
                                       f"{small:.3f} GiB on 8 ({large / small - 1:+.0%}); all peaks {peaks}")

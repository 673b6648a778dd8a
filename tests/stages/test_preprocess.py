"""The preprocess stage: what the model really receives, checked per sample."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from conftest import stage_json
from videosft.encoding import samples as encoding
from videosft.stages import preprocess
from videosft.data import sample_store
from videosft.encoding.chat import parse_answer, prompt_timestamps
from videosft.data.rejects import TooManyRejects
from videosft.data.sample_store import read_samples


@pytest.fixture(scope="module")
def samples(prepared):
    manifest = prepared / "preprocess" / "manifest.json"
    return read_samples(manifest, "train") + read_samples(manifest, "val")


def test_every_sample_is_what_the_budget_planned(samples, prepared):
    meta = sample_store.read_metadata(sample_store.sample_files(prepared / "preprocess" / "manifest.json", "train")[0])
    patch, merge, temporal = (meta["geometry"][k] for k in ("patch_size", "merge_size", "temporal_patch_size"))
    assert len(samples) == 12
    for row in samples:
        t, h, w = row["video_grid_thw"]
        assert t * temporal == len(row["frame_indices"]) == len(row["frame_times"])
        assert len(row["frame_indices"]) % 2 == 0 and 4 <= len(row["frame_indices"]) <= 16
        assert [h * patch, w * patch] == row["frame_size"]
        tokens_per_pair = h * w // merge**2
        assert meta["budget"]["min_tokens"] <= tokens_per_pair <= meta["budget"]["max_tokens"]
        assert row["visual_tokens"] == t * h * w // merge**2
        assert row["frames_shape"] == [len(row["frame_indices"]), 3, h * patch, w * patch]
        assert len(row["frames"]) == len(row["frame_indices"])
        assert row["input_tokens"] == len(row["input_ids"]) == row["visual_tokens"] + row["text_tokens"]


def test_labels_supervise_exactly_the_answer_and_its_end_token(samples, demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    for row in samples:
        supervised = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert supervised == [label for label in row["labels"] if label != -100]
        assert row["supervised_tokens"] == len(supervised) > 0
        assert tokenizer.decode(supervised) == row["answer"] + "<|im_end|>"
        first = row["labels"].index(next(label for label in row["labels"] if label != -100))
        assert all(label == -100 for label in row["labels"][:first])  # prompt and video masked
        assert parse_answer(row["answer"]) == [tuple(r) for r in row["keep_local"]] or \
            (row["answer"] == "none" and row["keep_local"] == [])


def test_answer_and_frame_times_share_the_window_clock(samples, demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    for row in samples:
        length = row["window_end"] - row["window_start"]
        assert all(0 <= t < length for t in row["frame_times"])
        assert row["frame_times"][0] < 0.5  # the clip starts at 0, not at the window's source time
        markers = prompt_timestamps(tokenizer.decode(row["input_ids"]))
        pairs = np.asarray(row["frame_times"]).reshape(-1, 2).mean(axis=1)
        assert markers == pytest.approx(pairs, abs=0.051)
        for start, end in parse_answer(row["answer"]) or []:
            assert 0 <= start < end <= length + 0.05


def preprocess_all(overrides: dict, windows, out):
    """One shard, then the gather step, as the workflow runs them."""
    assert preprocess.main(["--config", stage_json("preprocess", overrides), "--windows", str(windows),
                            "--out", str(out / "shards" / "0")]) == 0
    return preprocess.main(["--config", stage_json("preprocess", overrides), "--gather", str(out / "shards" / "0"),
                            "--out", str(out)])


def test_environment_budget_overrides_config_and_is_recorded(demo_config, prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("VIDEO_MAX_TOKEN_NUM", "2")
    monkeypatch.setenv("VIDEO_MIN_TOKEN_NUM", "1")
    out = tmp_path / "pre"
    assert preprocess_all(demo_config, prepared / "window" / "windows.parquet", out) == 0
    record = json.loads((out / "run_record.json").read_text())
    budget = record["results"]["budget"]
    assert budget["max_tokens"] == 2 and budget["max_tokens_from"] == "environment VIDEO_MAX_TOKEN_NUM"
    assert record["env"]["VIDEO_MAX_TOKEN_NUM"] == "2"
    for row in read_samples(out / "manifest.json", "train"):
        _, h, w = row["video_grid_thw"]
        assert h * w // 4 <= 2  # the budget took effect on the grid, not only in the config
    assert record["results"]["visual_tokens"]["max"] < 48


def test_an_overlong_sample_gets_a_smaller_budget_never_a_cut_answer(demo_config, prepared, tmp_path):
    windows = prepared / "window" / "windows.parquet"
    fit = {**demo_config, "data": {**demo_config["data"], "max_length": 200}, "video": {"min_tokens": 1}}
    assert preprocess_all(fit, windows, tmp_path / "fit") == 0
    rows = read_samples(tmp_path / "fit" / "manifest.json", "train") + \
        read_samples(tmp_path / "fit" / "manifest.json", "val")
    assert len(rows) == 12
    for row in rows:
        assert row["input_tokens"] <= 200 and row["budget_max_tokens"] < 16
        _, h, w = row["video_grid_thw"]
        assert h * w // 4 <= row["budget_max_tokens"]
        assert row["labels"][-2] != -100  # the answer's end token is still supervised

    reject = {**fit, "data": {**fit["data"], "overlong": "reject", "max_reject_fraction": 1.0}}
    with pytest.raises(ValueError, match="no train samples"):
        preprocess_all(reject, windows, tmp_path / "reject")
    rejects = [json.loads(line) for line in (tmp_path / "reject" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 12 and all("exceed data.max_length=200" in r["error"] for r in rejects)

    strict = {**demo_config, "data": {**demo_config["data"], "max_length": 200}}  # min_tokens 4 cannot fit
    with pytest.raises(TooManyRejects, match=r"\d+ of 12 windows rejected"):
        preprocess_all(strict, windows, tmp_path / "strict")
    assert "smallest per-frame budget" in (tmp_path / "strict" / "rejects.jsonl").read_text()


def test_the_trainer_refuses_an_unknown_schema_version(prepared, tmp_path):
    table = pq.read_table(sample_store.sample_files(prepared / "preprocess" / "manifest.json", "train")[0])
    meta = json.loads(table.schema.metadata[b"videosft"])
    meta["schema_version"] = 999
    path = tmp_path / "future.parquet"
    pq.write_table(table.replace_schema_metadata({"videosft": json.dumps(meta)}), path)
    with pytest.raises(ValueError, match="schema version 999"):
        sample_store.read_metadata(path)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1]}), plain)
    with pytest.raises(ValueError, match="not written by the preprocess stage"):
        sample_store.read_metadata(plain)


def test_a_marker_rounded_at_a_tie_is_not_taken_for_a_clock_error(demo_dir):
    """144 of 960 frames at 30 fps: pair 18's mean time is 8.15 s, which the processor writes as 8.1."""
    import torch
    from transformers import AutoProcessor

    from videosft import config as config_lib
    from videosft.media.budget import plan, resolve_budget
    from videosft.media.video import Clip

    processor = AutoProcessor.from_pretrained(demo_dir / "model")
    geometry = encoding.processor_geometry(processor)
    cfg = config_lib.for_stage("preprocess", {"video": {"fps": 4.5, "max_frames": 144, "max_tokens": 4}})
    budget = resolve_budget(cfg.video, environ={})

    class Video:
        def clip(self, start, end, budget, patch_size, merge_size, temporal_patch_size):
            frame_plan = plan(960, 30.0, 64, 64, budget, patch_size, merge_size, temporal_patch_size)
            picks = np.linspace(0, 959, frame_plan.frames).round().astype(int)
            frames = torch.zeros((frame_plan.frames, 3, frame_plan.height, frame_plan.width), dtype=torch.uint8)
            return Clip(frames, picks.tolist(), (picks / 30.0).tolist(), frame_plan, 64, 64, "decord")

    window = {"window_start": 0.0, "window_end": 32.0, "keep_local": [[8.0, 9.0]], "query": "the red ball"}
    clip, _, input_ids, *_ = encoding.encode_window(window, Video(), processor, cfg, budget, geometry)
    assert len(clip.frame_indices) == 144
    markers = prompt_timestamps(processor.tokenizer.decode(input_ids))
    assert markers[18] == 8.1 and encoding.frame_pair_times(clip.local_times, 2)[18] == pytest.approx(8.15)


@pytest.mark.parametrize("codec", ["none", "snappy", "zstd"])
def test_pixel_compression_is_the_configured_codec_and_round_trips(samples, tmp_path, codec):
    writer = sample_store.ShardWriter(tmp_path, {"schema_version": sample_store.SCHEMA_VERSION}, 2**30, codec)
    for row in samples[:3]:
        writer.add({key: row[key] for key in sample_store.SAMPLE_SCHEMA.names})
    files = writer.close()
    path = tmp_path / files[samples[0]["split"]][0]
    row_group = pq.ParquetFile(path).metadata.row_group(0)
    (column,) = [i for i in range(row_group.num_columns)
                 if row_group.column(i).path_in_schema == sample_store.FRAMES_LEAF]
    assert row_group.column(column).compression == codec.upper().replace("NONE", "UNCOMPRESSED")
    back = pq.read_table(path).to_pylist()
    assert [r["frames"] for r in back] == [r["frames"] for r in samples[:3] if r["split"] == samples[0]["split"]]


@pytest.mark.slow
def test_a_shard_log_has_progress_and_no_warning_per_window(prepared, demo_config, tmp_path):
    """A template without enable_thinking (the demo's) is not handed the keyword (transformers then warned
    about it on every window), so the log holds the stage's lines, not one warning per sample."""
    import subprocess
    import sys
    from collections import Counter

    result = subprocess.run([sys.executable, "-m", "videosft.stages.preprocess", "--config",
                             stage_json("preprocess", demo_config), "--windows",
                             str(prepared / "window" / "windows.parquet"), "--shard", "0", "--shards", "1",
                             "--out", str(tmp_path / "shard")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert not [line for line in lines if "processor_kwargs" in line]
    repeated = {line: n for line, n in Counter(lines).items() if n > 1 and "warn" in line.lower()}
    assert not repeated, repeated
    assert any(line.startswith("preprocess shard 0/1: 12 samples") for line in lines), lines[-5:]

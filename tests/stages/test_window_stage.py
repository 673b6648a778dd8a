"""The window stage on the demo videos, and on annotations with every kind of bad line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import stage_json
from videosft import window
from videosft.rejects import TooManyRejects


def run_window(annotations: Path, root: Path, out: Path, **window_cfg):
    overrides = {"data": {"annotations": str(annotations), "root": str(root), "max_reject_fraction": 1.0},
                 "window": window_cfg}
    assert window.main(["--config", stage_json("window", overrides), "--out", str(out)]) == 0
    return pq.read_table(out / "windows.parquet").to_pylist(), json.loads((out / "run_record.json").read_text())


def test_demo_windows_are_realigned_and_split_by_video(demo_dir, tmp_path):
    rows, record = run_window(demo_dir / "annotations.jsonl", demo_dir / "videos", tmp_path)
    annotations = {json.loads(l)["video"]: json.loads(l) for l in (demo_dir / "annotations.jsonl").read_text().splitlines()}
    assert len(rows) == 12  # 6 videos x 16 s / 8 s windows
    splits: dict[str, set] = {}
    for row in rows:
        splits.setdefault(row["video"], set()).add(row["split"])
        length = row["window_end"] - row["window_start"]
        for (ls, le), (ss, se) in zip(row["keep_local"], row["keep_source"]):
            assert 0 <= ls < le <= length
            assert ls + row["window_start"] == pytest.approx(ss) and le + row["window_start"] == pytest.approx(se)
        # every source range that overlaps this window by at least min_fragment is present, clipped
        expected = [(max(s, row["window_start"]), min(e, row["window_end"])) for s, e in annotations[row["video"]]["keep"]]
        expected = [r for r in expected if r[1] - r[0] >= 0.25]
        assert [tuple(r) for r in row["keep_source"]] == pytest.approx(expected)
    assert all(len(s) == 1 for s in splits.values()), "a video is in both splits"
    assert {next(iter(s)) for s in splits.values()} == {"train", "val"}
    counts = record["results"]["counts"]
    assert counts["windows"] == 12 and counts["videos"] == 6 and record["results"]["rejects"]["count"] == 0


def test_a_range_crossing_the_window_edge_is_clipped_and_short_fragments_counted(demo_dir, tmp_path):
    annotations = tmp_path / "a.jsonl"
    annotations.write_text(json.dumps({"video": "video_000.mp4", "keep": [[6.0, 10.0], [15.9, 16.0]]}) + "\n")
    rows, record = run_window(annotations, demo_dir / "videos", tmp_path / "out")
    first, second = rows
    assert first["keep_local"] == [[6.0, 8.0]] and first["keep_source"] == [[6.0, 8.0]]
    assert second["keep_local"] == [[0.0, 2.0]] and second["keep_source"] == [[8.0, 10.0]]
    counts = record["results"]["counts"]
    assert counts["fragments_clipped"] == 2 and counts["fragments_dropped"] == 1


def test_bad_lines_are_rejected_one_by_one_and_the_rest_processed(demo_dir, tmp_path):
    root = tmp_path / "videos"
    shutil.copytree(demo_dir / "videos", root)
    (root / "not_a_video.mp4").write_text("hello")
    truncated = (demo_dir / "videos" / "video_001.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(truncated[: len(truncated) // 20])
    outside = tmp_path / "outside.mp4"
    shutil.copy(demo_dir / "videos" / "video_002.mp4", outside)
    lines = [
        json.dumps({"video": "video_000.mp4", "keep": [[1.0, 2.0]]}),  # good
        "{not json",
        json.dumps({"video": "missing.mp4", "keep": []}),
        json.dumps({"video": "video_002.mp4", "keep": [[3.0, 2.0]]}),
        json.dumps({"video": "video_003.mp4", "keep": [[-1.0, 2.0]]}),
        '{"video": "video_004.mp4", "keep": [[NaN, 2.0]]}',
        json.dumps({"video": "video_005.mp4", "keep": [[10.0, 40.0]]}),  # past the 16 s duration
        json.dumps({"video": "video_000.mp4", "keep": [[1.0, 2.0]]}),  # duplicate
        json.dumps({"video": "not_a_video.mp4", "keep": []}),
        json.dumps({"video": "truncated.mp4", "keep": []}),
        json.dumps({"video": "../outside.mp4", "keep": []}),
        json.dumps({"video": str(outside), "keep": []}),
        json.dumps({"video": "video_001.mp4", "query": "q", "keep": [[1.0, 2.0]]}),  # good
    ]
    annotations = tmp_path / "bad.jsonl"
    annotations.write_text("\n".join(lines) + "\n")
    rows, record = run_window(annotations, root, tmp_path / "out")
    rejects = [json.loads(l) for l in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    rejected_lines = sorted(int(r["where"].rsplit(":", 1)[1]) for r in rejects)
    assert {row["video"] for row in rows} == {"video_000.mp4", "video_001.mp4"}
    assert 2 in rejected_lines and 8 in rejected_lines and 12 in rejected_lines
    assert len(rejects) >= 10, rejects  # every bad line except perhaps a decodable truncated file
    messages = "\n".join(r["error"] for r in rejects)
    for fragment in ("not valid JSON", "does not exist", "start >= end", "before 0", "non-finite",
                     "after the video's duration", "duplicate", "leaves data.root", "absolute"):
        assert fragment in messages, fragment
    assert record["results"]["rejects"]["count"] == len(rejects)

    strict = {"data": {"annotations": str(annotations), "root": str(root)}, "window": {}}
    with pytest.raises(TooManyRejects, match="rejected"):
        window.main(["--config", stage_json("window", strict), "--out", str(tmp_path / "strict")])
    assert len((tmp_path / "strict" / "rejects.jsonl").read_text().splitlines()) == len(rejects)

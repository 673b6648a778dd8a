"""The window stage on the demo videos, and on annotations with every kind of bad line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import assert_ranges_close, stage_json
from videosft.stages import window
from videosft.data.rejects import TooManyRejects
from videosft.errors import REASONS
from videosft.data.windows import read_windows


def run_window(annotations: Path, root: Path, out: Path, **window_cfg):
    overrides = {"data": {"annotations": str(annotations), "root": str(root), "max_reject_fraction": 1.0},
                 "window": window_cfg}
    assert window.main(["--config", stage_json("window", overrides), "--out", str(out)]) == 0
    return read_windows(out / "windows.parquet"), json.loads((out / "run_record.json").read_text())


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
        assert_ranges_close(row["keep_source"], expected)
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
    # each kind of problem has its code and its reason in words a person acts on, counted per kind
    code_of = {int(r["where"].rsplit(":", 1)[1]): r["code"] for r in rejects}
    assert {line: code_of[line] for line in (2, 3, 4, 5, 6, 7, 8, 9, 11, 12)} == {
        2: "not_json", 3: "video_missing", 4: "bad_keep_range", 5: "bad_keep_range", 6: "bad_keep_range",
        7: "keep_after_end", 8: "duplicate", 9: "video_undecodable", 11: "video_outside_root",
        12: "video_outside_root"}
    assert all(r["reason"] == REASONS[r["code"]] and not r["reason"].endswith("Error") for r in rejects)
    assert record["results"]["rejects"]["by_reason"]["keep range ends after the video"] == 1

    strict = {"data": {"annotations": str(annotations), "root": str(root)}, "window": {}}
    with pytest.raises(TooManyRejects, match="rejected"):
        window.main(["--config", stage_json("window", strict), "--out", str(tmp_path / "strict")])
    assert len((tmp_path / "strict" / "rejects.jsonl").read_text().splitlines()) == len(rejects)


QVHIGHLIGHTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "qvhighlights" / "highlight_val_release.jsonl"


@pytest.mark.skipif(not QVHIGHLIGHTS.exists(), reason="shared QVHighlights annotations not present")
def test_all_of_qvhighlights_val_keeps_the_invariants(tmp_path):
    import random

    lines = QVHIGHLIGHTS.read_text().splitlines()
    overrides = {"data": {"annotations": str(QVHIGHLIGHTS), "root": str(tmp_path), "format": "qvhighlights",
                          "duration": "annotation"},
                 "window": {"length": 30.0, "stride": 20.0, "min_fragment": 1.0, "max_empty_fraction": 1.0}}
    assert window.main(["--config", stage_json("window", overrides), "--out", str(tmp_path / "a")]) == 0
    rows = read_windows(tmp_path / "a" / "windows.parquet")
    truth = {(json.loads(l)["vid"] + ".mp4", json.loads(l)["query"]): json.loads(l) for l in lines}
    assert len({(r["video"], r["query"]) for r in rows}) == len(lines) == len(truth)

    split_of: dict[str, str] = {}
    for row in rows:
        assert split_of.setdefault(row["video"], row["split"]) == row["split"], "video in both splits"
        gt = truth[(row["video"], row["query"])]
        start, end = row["window_start"], row["window_end"]
        assert 0 <= start < end <= gt["duration"] and end - start == pytest.approx(30.0)
        expected = []
        for s, e in sorted(gt["relevant_windows"]):
            clipped = (max(s, start), min(e, end))
            if clipped[1] - clipped[0] >= 1.0:
                if expected and clipped[0] <= expected[-1][1]:
                    expected[-1] = (expected[-1][0], max(expected[-1][1], clipped[1]))
                else:
                    expected.append(clipped)
        assert_ranges_close(row["keep_source"], expected)
        for (ls, le), (ss, se) in zip(row["keep_local"], row["keep_source"]):
            assert 0 <= ls < le <= end - start
            assert ls + start == pytest.approx(ss, abs=1e-9) and le + start == pytest.approx(se, abs=1e-9)
    # every relevant window is covered by some window's local ranges (nothing lost uncounted)
    counts = json.loads((tmp_path / "a" / "run_record.json").read_text())["results"]["counts"]
    assert counts["windows"] == len(rows) and counts["annotations"] == len(lines)
    assert counts["videos_val"] > 0 and counts["videos_train"] > counts["videos_val"]

    shuffled = tmp_path / "shuffled.jsonl"
    random.Random(1).shuffle(lines)
    shuffled.write_text("\n".join(lines) + "\n")
    overrides["data"]["annotations"] = str(shuffled)
    assert window.main(["--config", stage_json("window", overrides), "--out", str(tmp_path / "b")]) == 0
    again = {r["window_id"]: r["split"] for r in read_windows(tmp_path / "b" / "windows.parquet")}
    assert again == {r["window_id"]: r["split"] for r in rows}, "the split changed with the file order"


def test_windows_with_nothing_to_keep_are_capped_per_split(demo_dir, tmp_path):
    annotations = tmp_path / "a.jsonl"
    lines = [json.dumps({"video": f"video_{i:03d}.mp4", "keep": [[1.0, 2.0]] if i < 2 else []}) for i in range(6)]
    annotations.write_text("\n".join(lines) + "\n")
    rows, record = run_window(annotations, demo_dir / "videos", tmp_path / "out", max_empty_fraction=0.5,
                              val_fraction=0.0)
    empty = [r for r in rows if not r["keep_local"]]
    assert len(rows) - len(empty) == 2 and len(empty) == 2  # 10 empty windows made, capped at half
    counts = record["results"]["counts"]
    assert counts["windows_empty_made"] == 10 and counts["windows_empty_dropped"] == 8

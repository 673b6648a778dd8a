"""Videos as people have them (issue 35): files the tests encode, each with the decision the stages take
and, for accepted files, frames as a player shows them: non-square pixels, AV1, an empty file."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from videosft.errors import Rejected
from videosft.media.budget import Budget
from videosft.media.video import VideoFile

from encoded_videos import bars_video, circle_video

BUDGET = Budget(fps=4.0, min_frames=2, max_frames=4, min_tokens=16, max_tokens=4096, min_tokens_from="test",
                max_tokens_from="test")


def shown_roundness(frames) -> float:
    """Width over height of the bright shape in (T, 3, H, W) frames: 1 for a circle."""
    bright = frames[0].float().mean(0) > 128
    rows, columns = np.flatnonzero(bright.any(1).numpy()), np.flatnonzero(bright.any(0).numpy())
    return (columns[-1] - columns[0] + 1) / (rows[-1] - rows[0] + 1)


@pytest.mark.parametrize("coded,pixel_aspect", [((180, 240), Fraction(4, 3)), ((240, 360), Fraction(32, 27)),
                                                ((192, 256), Fraction(1))])
def test_non_square_pixels_reach_the_model_as_a_player_shows_them(coded, pixel_aspect, tmp_path):
    video = VideoFile(circle_video(tmp_path / "dv.mp4", "libx264", coded, pixel_aspect))
    assert video.pixel_aspect == pixel_aspect
    clip = video.clip(0.0, 1.5, BUDGET, patch_size=16, merge_size=2, temporal_patch_size=2)
    # the plan scales each side to a whole number of patches (its own, small, aspect change), so the
    # circle's roundness is that of the plan's scaling of the display size (squeezed, it was 0.75-0.84)
    display_width = coded[1] * pixel_aspect
    planned = (clip.plan.width / display_width) / (clip.plan.height / coded[0])
    assert shown_roundness(clip.frames) == pytest.approx(float(planned), abs=0.04)
    assert abs(float(planned) - 1) < 0.1


def test_the_rendered_cut_has_square_pixels_at_the_display_size(tmp_path):
    import av

    from videosft.media.clock import media_clock
    from videosft.media.render import render_cut

    source = circle_video(tmp_path / "dvd.mp4", "libx264", (240, 360), Fraction(32, 27))
    video = VideoFile(source)
    cut = render_cut(source, [(0.0, 1.0)], tmp_path / "cut.mp4", media_clock(video))
    with av.open(str(cut)) as container:
        stream = container.streams.video[0]
        assert (stream.height, stream.width) == (240, 426)  # 360 x 32/27 = 426.7, even
        assert (stream.sample_aspect_ratio or Fraction(1)) in (Fraction(1), Fraction(0))
    rendered = VideoFile(cut).clip(0.0, 1.0, BUDGET, patch_size=16, merge_size=2, temporal_patch_size=2)
    planned = (rendered.plan.width / 426) / (rendered.plan.height / 240)  # the plan's own scaling, as above
    assert shown_roundness(rendered.frames) == pytest.approx(planned, abs=0.04)


def test_an_empty_file_is_named_as_empty_and_an_audio_file_as_without_video(tmp_path):
    import av

    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(Rejected, match="empty file") as caught:
        VideoFile(tmp_path / "empty.mp4")
    assert caught.value.code == "video_empty"
    with av.open(str(tmp_path / "talk.m4a"), "w") as container:
        sound = container.add_stream("aac", rate=48000)
        sound.layout = "stereo"
        for block in range(8):
            silence = av.AudioFrame.from_ndarray(np.zeros((2, 1024), np.float32), format="fltp", layout="stereo")
            silence.sample_rate, silence.pts = 48000, block * 1024
            container.mux(sound.encode(silence))
        container.mux(sound.encode())
    with pytest.raises(Rejected, match=r"no video stream \(an audio-only file\?\)"):
        VideoFile(tmp_path / "talk.m4a")


def test_ffmpegs_messages_stay_out_of_the_terminal_unless_a_reject_quotes_them(tmp_path, capfd):
    """PyAV's reads of a damaged file keep FFmpeg's complaints (decord's own bundled FFmpeg still prints)."""
    from videosft.media.pyav_reader import PyAVReader

    whole = bars_video(tmp_path / "whole.mp4", frames=240, mux={"movflags": "faststart"})
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[:int(whole.stat().st_size * 0.6)])
    capfd.readouterr()
    reader = PyAVReader(cut)
    reader.get_batch([0, len(reader) - 1])
    assert capfd.readouterr().err == ""


def pyav_frames(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_av1_decodes_by_pyav_with_the_frames_and_times_of_the_same_video_in_h264(tmp_path):
    av1 = VideoFile(bars_video(tmp_path / "web.mp4", codec="libsvtav1"))
    h264 = VideoFile(bars_video(tmp_path / "same.mp4"))
    assert av1.decoding.startswith("pyav (decord:") and h264.decoding == "decord"
    assert np.allclose(av1.timestamps, h264.timestamps, atol=1e-6) and av1.duration == pytest.approx(h264.duration)
    picks = [0, 7, 30, 47, 7]
    difference = np.abs(av1.frames(picks).astype(int) - h264.frames(picks).astype(int)).mean()
    assert difference < 12  # two lossy codecs of one picture; another frame differs by ~30
    assert np.abs(av1.frames([0]).astype(int) - h264.frames([10]).astype(int)).mean() > 2 * difference
    clip = av1.clip(0.5, 1.5, BUDGET, patch_size=16, merge_size=2, temporal_patch_size=2)
    assert clip.decoding == av1.decoding and clip.frames.shape[0] == 4


@pytest.mark.parametrize("layout", ["faststart", "index at the end", "mkv"])
def test_a_cut_off_file_keeps_what_decodes_and_names_the_rest(layout, tmp_path):
    suffix, mux = {"faststart": (".mp4", {"movflags": "faststart"}), "index at the end": (".mp4", {}),
                   "mkv": (".mkv", {})}[layout]
    whole = bars_video(tmp_path / f"whole{suffix}", frames=240, mux=mux)
    data = whole.read_bytes()
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(data[:int(len(data) * 0.6)])
    if layout == "index at the end":  # the MP4's index went with the end: nothing can be read, and it says so
        with pytest.raises(Rejected, match="could not be decoded .*moov atom not found.*index is missing: cut off") as caught:
            VideoFile(cut)
        assert caught.value.code == "video_undecodable"
        return
    video = VideoFile(cut)
    assert 3.0 < video.duration < 9.0  # of 10 s: a 60% cut of the bytes
    if layout == "faststart":  # the index states 10 s: the windows past what decodes are named
        assert video.truncated == (pytest.approx(video.duration), pytest.approx(10.0))
        with pytest.raises(Rejected, match=rf"truncated: decodable up to {video.duration:.2f} s of 10.00 s"):
            video.clip(video.duration - 1.0, video.duration + 1.0, BUDGET, 16, 2, 2)
    inside = video.clip(1.0, 3.0, BUDGET, patch_size=16, merge_size=2, temporal_patch_size=2)
    reference = VideoFile(whole).clip(1.0, 3.0, BUDGET, patch_size=16, merge_size=2, temporal_patch_size=2)
    assert inside.frame_indices == reference.frame_indices
    assert inside.local_times == pytest.approx(reference.local_times, abs=1e-6)  # decord's times are float32
    assert (inside.frames.float() - reference.frames.float()).abs().mean() < 1  # the same decoded pictures


def comb(frame: np.ndarray) -> float:
    """How far adjacent rows differ: two instants woven together make it large."""
    return float(np.abs(np.diff(frame.astype(float), axis=0)).mean())


def test_interlaced_footage_is_deinterlaced_to_one_frame_per_frame_time(tmp_path):
    woven = bars_video(tmp_path / "broadcast.mp4", woven=True)
    progressive = bars_video(tmp_path / "progressive.mp4")
    video = VideoFile(woven)
    assert video.decoding == "pyav, deinterlaced (bwdif)" and VideoFile(progressive).decoding == "decord"
    assert np.allclose(video.timestamps, VideoFile(progressive).timestamps, atol=1e-6)  # one frame per frame time
    raw, control = pyav_frames(woven), pyav_frames(progressive)
    shown = video.frames([10, 20, 30])
    for index, frame in zip([10, 20, 30], shown):
        assert comb(raw[index]) > 1.5 * comb(control[index])  # as stored: two instants per frame
        assert comb(frame) < 0.8 * comb(raw[index])  # as shown: one

"""Cut lists that land on the right frames: a corpus of encoded videos (standard rates, 29.97 spelled two
ways, embedded start timecodes drop and non-drop, an edit list, jittered and variable rates, names
with spaces, '#', '%' and non-ASCII, audio), each cut written as EDL, FCP 7 XML and .otio and read
back by readers other than the writers: pycmx for the EDL, the standard library's minidom for the
XML, plain JSON for the .otio, OpenTimelineIO's own timecode arithmetic. Each clip must start and
end on the frame the keep range names, in the media's own numbering: the frame a player shows at
that second, counted from the first decoded frame, plus the file's start timecode."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from xml.dom import minidom

import numpy as np
import pytest

from videosft.media.clock import MediaClock, from_timecode, media_clock, to_timecode
from videosft.media.editor_timelines import read_ranges, write_timelines
from videosft.media.video import VideoFile

NTSC30, NTSC24, NTSC60 = Fraction(30000, 1001), Fraction(24000, 1001), Fraction(60000, 1001)
TICK = Fraction(1, 90000)


def encode(path: Path, rate: Fraction, times: list[float], timecode: str | None = None, audio: bool = False) -> Path:
    """An H.264 video whose frames show at ``times`` (seconds), tagged ``rate``, with a start timecode and
    silent stereo audio if asked."""
    import av

    with av.open(str(path), "w") as container:
        if timecode:
            container.metadata["timecode"] = timecode  # the MOV muxer writes it as a tmcd track
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.time_base = TICK
        sound = container.add_stream("aac", rate=48000) if audio else None
        if sound is not None:
            sound.layout = "stereo"
        for index, seconds in enumerate(times):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 7 % 256, np.uint8), format="rgb24")
            frame.time_base, frame.pts = TICK, round(seconds / TICK)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if sound is not None:
            for block in range(int(times[-1] * 48000 / 1024) + 1):
                silence = av.AudioFrame.from_ndarray(np.zeros((2, 1024), np.float32), format="fltp", layout="stereo")
                silence.sample_rate, silence.pts = 48000, block * 1024
                container.mux(sound.encode(silence))
            container.mux(sound.encode())
    return path


def steady(rate: Fraction, count: int, offset: float = 0.0) -> list[float]:
    return [offset + float(i / rate) for i in range(count)]


# name -> (file name, tagged rate, frame times, start timecode, audio, the clock expected: rate, drop, timecode)
CORPUS = {
    "23.976": ("a 23976.mov", NTSC24, steady(NTSC24, 60), None, False, (NTSC24, False, "00:00:00:00")),
    "25 with timecode": ("b25 #1.mov", Fraction(25), steady(Fraction(25), 60), "10:00:00:00", False,
                         (Fraction(25), False, "10:00:00:00")),
    "29.97 drop-frame": ("c 2997 df.mov", NTSC30, steady(NTSC30, 75), "01:00:00;00", True, (NTSC30, True, "01:00:00;00")),
    "29.97 non-drop": ("d%20ndf.mov", NTSC30, steady(NTSC30, 75), "10:00:00:00", False, (NTSC30, False, "10:00:00:00")),
    "29.97 as 2997/100": ("e 2997.mp4", Fraction(2997, 100), steady(Fraction(2997, 100), 75), None, False,
                          (NTSC30, False, "00:00:00:00")),
    "30": ("f30 ü.mp4", Fraction(30), steady(Fraction(30), 75), None, False, (Fraction(30), False, "00:00:00:00")),
    "59.94 drop-frame": ("g 5994.mov", NTSC60, steady(NTSC60, 150), "00:59:59;30", False, (NTSC60, True, "00:59:59;30")),
    "60": ("h60.mp4", Fraction(60), steady(Fraction(60), 150), None, False, (Fraction(60), False, "00:00:00:00")),
    "15 screen recording": ("i 15fps.mp4", Fraction(15), steady(Fraction(15), 45), None, False,
                            (Fraction(15), False, "00:00:00:00")),
    "edit list: first frame at 1.0 s": ("j offset.mp4", Fraction(25), steady(Fraction(25), 60, offset=1.0), None, False,
                                        (Fraction(25), False, "00:00:00:00")),
    "phone jitter ~30.04": ("k phone.mp4", Fraction(30), [i / 30.04 + (0.002 if i % 3 == 1 else 0) for i in range(90)],
                            None, False, (Fraction(30), False, "00:00:00:00")),
    "variable 24 then 30": ("l vfr.mp4", Fraction(30), [i / 24 for i in range(48)] + [2 + i / 30 for i in range(60)],
                            None, False, (Fraction(30), False, "00:00:00:00")),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[Path, MediaClock, VideoFile]]:
    folder = tmp_path_factory.mktemp("corpus")
    made = {}
    for name, (file_name, rate, times, timecode, audio, _) in CORPUS.items():
        path = encode(folder / file_name, rate, times, timecode, audio)
        video = VideoFile(path)
        made[name] = (path, media_clock(video), video)
    return made


def keep_ranges(video: VideoFile) -> list[tuple[float, float]]:
    """Three ranges between frames, one starting exactly on a frame's time, one from the video's first second."""
    t = video.timestamps
    return [(float(t[0]), float(t[3] + 0.004)), (float(t[10]), float(t[20] - 0.003)),
            (float((t[-12] + t[-11]) / 2), float(video.duration))]


def media_frame(video: VideoFile, clock: MediaClock, seconds: float) -> int:
    """The frame a player shows from ``seconds`` on, in the media's numbering: for evenly spaced frames
    the decoded frame's index; for a variable rate, its time in frames of the timeline's rate."""
    if clock.rate_rule.startswith("variable"):
        return clock.start_frame + round((seconds - video.timestamps[0]) * clock.rate)
    at = int(np.argmin(np.abs(video.timestamps - seconds)))
    index = at if seconds <= video.duration - 1e-6 else len(video.timestamps)
    return clock.start_frame + index


def otio_frames(timecode: str, rate: Fraction) -> int:
    """OpenTimelineIO's reading of a timecode (not ours), where it accepts the rate."""
    import opentimelineio as otio

    if not otio.opentime.RationalTime.is_smpte_timecode_rate(float(rate)):
        return from_timecode(timecode, rate)
    return round(otio.opentime.from_timecode(timecode, float(rate)).value)


def read_edl(path: Path, rate: Fraction) -> list[tuple[int, int]]:
    import pycmx

    with open(path) as handle:
        edl = pycmx.parse_cmx3600(handle)
    return [(otio_frames(edit.source_in, rate), otio_frames(edit.source_out, rate))
            for event in edl.events for edit in event.edits]


def read_xml(path: Path) -> list[tuple[int, int]]:
    document = minidom.parse(str(path))
    if not document.getElementsByTagName("clipitem"):
        return []
    start = int(document.getElementsByTagName("file")[0].getElementsByTagName("timecode")[0]
                .getElementsByTagName("frame")[0].firstChild.data)
    video = document.getElementsByTagName("video")[0]
    items = video.getElementsByTagName("clipitem")
    value = lambda item, tag: int(item.getElementsByTagName(tag)[0].firstChild.data)  # noqa: E731
    return [(start + value(item, "in"), start + value(item, "out")) for item in items]


def read_otio(path: Path) -> list[tuple[int, int]]:
    document = json.loads(path.read_text())
    video = next(track for track in document["tracks"]["children"] if track["kind"] == "Video")
    spans = [clip["source_range"] for clip in video["children"]]
    return [(round(s["start_time"]["value"]), round(s["start_time"]["value"] + s["duration"]["value"])) for s in spans]


@pytest.mark.parametrize("name", list(CORPUS))
def test_every_timeline_lands_on_the_kept_frames_in_the_medias_own_numbering(corpus, name, tmp_path):
    path, clock, video = corpus[name]
    rate, drop, timecode = CORPUS[name][-1]
    assert (clock.rate, clock.drop_frame, clock.start_timecode) == (rate, drop, timecode), clock
    assert clock.first_frame_seconds == pytest.approx(video.timestamps[0]) and (clock.audio_channels > 0) == CORPUS[name][4]
    ranges = keep_ranges(video)
    files = write_timelines(path, clock, ranges, tmp_path, path.stem, f"{name} cut")
    expected = [(media_frame(video, clock, start), media_frame(video, clock, end)) for start, end in ranges]
    readers = {"edl": read_edl(Path(files["edl"]), rate), "xml": read_xml(Path(files["xml"])),
               "otio": read_otio(Path(files["otio"]))}
    for suffix, frames in readers.items():
        assert len(frames) == len(expected), (suffix, frames)
        for (first, end), (want_first, want_end) in zip(frames, expected):
            assert abs(first - want_first) <= 1 and abs(end - want_end) <= 1, (suffix, frames, expected)
    for suffix in ("edl", "xml", "otio"):  # our own reader gives back the seconds, to one frame
        for (start, end), (got_start, got_end) in zip(ranges, read_ranges(Path(files[suffix]), clock)):
            assert abs(got_start - start) <= 1 / rate and abs(got_end - end) <= 1 / rate, suffix


def test_names_and_headers_are_portable(corpus, tmp_path):
    path, clock, video = corpus["29.97 drop-frame"]
    files = write_timelines(path, clock, keep_ranges(video), tmp_path, "cut", "title")
    edl = Path(files["edl"]).read_text().splitlines()
    assert edl[:2] == ["TITLE: title", "FCM: DROP FRAME"]
    event = edl[3].split()
    assert event[1] == "C2997DF" and event[2] == "AA/V"  # a reel of 8 letters and digits; audio and video
    assert f"* FROM CLIP NAME:  {path.name}" in edl and f"* SOURCE FILE: {path.resolve().as_uri()}" in edl
    document = minidom.parse(files["xml"])
    assert document.getElementsByTagName("pathurl")[0].firstChild.data == path.resolve().as_uri()
    characteristics = document.getElementsByTagName("format")[0].getElementsByTagName("samplecharacteristics")[0]
    field = lambda tag: characteristics.getElementsByTagName(tag)[0].firstChild.data  # noqa: E731
    assert (field("width"), field("height"), field("timebase"), field("ntsc")) == ("64", "48", "30", "TRUE")
    file_code = document.getElementsByTagName("file")[0].getElementsByTagName("timecode")[0]
    assert file_code.getElementsByTagName("string")[0].firstChild.data == "01:00:00;00"
    assert file_code.getElementsByTagName("displayformat")[0].firstChild.data == "DF"
    sequence_audio = [node for node in document.getElementsByTagName("audio") if node.parentNode.parentNode.tagName == "sequence"]
    assert len(sequence_audio[0].getElementsByTagName("track")) == 2  # one track per channel
    import opentimelineio as otio  # and the .otio's media reference is the same URL

    read = otio.adapters.read_from_file(files["otio"])
    assert {clip.media_reference.target_url for clip in read.find_clips()} == {path.resolve().as_uri()}
    pound = corpus["25 with timecode"][0]
    assert "%231" in pound.resolve().as_uri()  # '#' percent-encoded in every URL written


def test_an_empty_cut_is_a_valid_file_in_every_format(corpus, tmp_path):
    path, clock, _ = corpus["29.97 non-drop"]
    files = write_timelines(path, clock, [], tmp_path, "none", "nothing kept")
    assert Path(files["edl"]).read_text().splitlines()[:2] == ["TITLE: nothing kept", "FCM: NON-DROP FRAME"]
    assert read_edl(Path(files["edl"]), NTSC30) == [] == read_xml(Path(files["xml"])) == read_otio(Path(files["otio"]))


@pytest.mark.parametrize("rate,drop", [(NTSC24, False), (Fraction(25), False), (NTSC30, True), (Fraction(30), False),
                                       (NTSC60, True), (Fraction(60), False)])
def test_timecodes_agree_with_opentimelineio_at_every_rate(rate, drop):
    import opentimelineio as otio

    for frames in [*range(0, 4000, 13), *range(17970, 18010), *range(107880, 107900), 1_000_000]:
        code = to_timecode(frames, rate, drop)
        assert code == otio.opentime.to_timecode(otio.opentime.RationalTime(frames, float(rate)), float(rate), drop)
        assert from_timecode(code, rate) == frames


@pytest.mark.parametrize("name", ["29.97 drop-frame", "variable 24 then 30", "15 screen recording"])
def test_the_rendered_cut_runs_at_the_sources_rate_and_lasts_as_long_as_its_ranges(corpus, name, tmp_path):
    from videosft.media.render import render_cut

    path, clock, video = corpus[name]
    ranges = keep_ranges(video)[1:]
    cut = VideoFile(render_cut(path, ranges, tmp_path / "cut.mp4", clock))
    kept = [i for start, end in ranges for i in video.window_frames(start, end)]
    assert len(cut.reader) == len(kept)
    shown = np.diff(np.append(video.timestamps, video.duration))[kept].sum()
    assert abs(cut.duration - cut.timestamps[0] - shown) <= 1 / float(clock.rate)
    if not clock.rate_rule.startswith("variable"):
        import av

        with av.open(str(tmp_path / "cut.mp4")) as container:
            assert container.streams.video[0].average_rate == clock.rate

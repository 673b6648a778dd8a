"""Cut lists as the files editors open: an OpenTimelineIO timeline (.otio), a CMX 3600 EDL (.edl) and
Final Cut Pro 7 XML (.xml, which Premiere and Resolve import), each clip a kept range of the source.

Every file counts in the source's own frames (:mod:`videosft.media.clock`): its rate, its start
timecode, frame 0 being the first decoded frame. A kept range ``[s, e)`` of player seconds becomes
frames ``[frame_at(s), frame_at(e))``: the EDL's source in/out timecodes, the XML's in/out (frames
from the media's start, beside the file's ``<timecode>``) and the .otio clip's source range (frames
since 00:00:00:00, its media's available range starting at the start timecode). Record times in the
EDL and XML sequences start at 01:00:00:00. Where the source has audio, each clip takes its audio
too (EDL channel ``AA/V``, an audio track in the XML and .otio), so the cut plays with sound.

Names are made safe where each format needs it: the EDL's reel is the file name's first 8 letters
and digits (CMX 3600 reels allow no more), the full name in ``* FROM CLIP NAME`` and the file's URL
in ``* SOURCE FILE``; media are percent-encoded ``file://`` URLs (a ``#``, ``%`` or space in a name
survives).
"""

from __future__ import annotations

import re
from pathlib import Path
from xml.etree import ElementTree

from .clock import MediaClock, from_timecode, to_timecode
from .timeline import Range

RECORD_START = "01:00:00:00"
EDITOR_FILES = ("otio", "edl", "xml")


def clip_frames(ranges: list[Range], clock: MediaClock) -> list[tuple[int, int]]:
    """Each kept range as [first, end) frames of the file, inside the media; ranges under one frame vanish."""
    first, last = clock.start_frame, clock.start_frame + clock.frames
    frames = [(max(first, clock.frame_at(start)), min(last, clock.frame_at(end))) for start, end in ranges]
    return [(a, b) for a, b in frames if b > a]


def reel_name(video: Path) -> str:
    """A CMX 3600 reel: up to 8 ASCII letters and digits of the file name (AX when it has none)."""
    return (re.sub(r"[^A-Za-z0-9]", "", Path(video).stem).upper()[:8]) or "AX"


def edl_text(video: Path, clock: MediaClock, ranges: list[Range], title: str) -> str:
    """A CMX 3600 EDL: one cut event per kept range, source timecodes in the file's own numbering."""
    lines = [f"TITLE: {title}", f"FCM: {'DROP FRAME' if clock.drop_frame else 'NON-DROP FRAME'}", ""]
    channel = "AA/V" if clock.audio_channels else "V"
    record = from_timecode(RECORD_START, clock.rate, clock.drop_frame)
    for number, (first, end) in enumerate(clip_frames(ranges, clock), start=1):
        length = end - first
        codes = [clock.timecode(first), clock.timecode(end), to_timecode(record, clock.rate, clock.drop_frame),
                 to_timecode(record + length, clock.rate, clock.drop_frame)]
        lines += [f"{number:03d}  {reel_name(video):<8} {channel:<5} C        {' '.join(codes)}",
                  f"* FROM CLIP NAME:  {Path(video).name}", f"* SOURCE FILE: {Path(video).resolve().as_uri()}", ""]
        record += length
    return "\n".join(lines) + "\n"


def otio_timeline(video: Path, clock: MediaClock, ranges: list[Range], title: str):
    """The cut as an OpenTimelineIO timeline: a video track, and an audio track where the source has audio."""
    import opentimelineio as otio

    rate = float(clock.rate)

    def span(first: int, count: int):
        return otio.opentime.TimeRange(otio.opentime.RationalTime(first, rate), otio.opentime.RationalTime(count, rate))

    media = otio.schema.ExternalReference(target_url=Path(video).resolve().as_uri(),
                                          available_range=span(clock.start_frame, clock.frames))
    media.metadata["videosft"] = {"clock": clock.as_json()}
    result = otio.schema.Timeline(name=title, global_start_time=otio.opentime.RationalTime(
        from_timecode(RECORD_START, clock.rate, clock.drop_frame), rate))
    kinds = [otio.schema.TrackKind.Video] + ([otio.schema.TrackKind.Audio] if clock.audio_channels else [])
    for kind in kinds:
        track = otio.schema.Track(name="V1" if kind == otio.schema.TrackKind.Video else "A1", kind=kind)
        for index, (first, end) in enumerate(clip_frames(ranges, clock), start=1):
            clip = otio.schema.Clip(name=f"{Path(video).stem}_keep{index:03d}", media_reference=media.clone(),
                                    source_range=span(first, end - first))
            clip.metadata["cmx_3600"] = {"reel": reel_name(video)}
            track.append(clip)
        result.tracks.append(track)
    return result


def fcp_xml(video: Path, clock: MediaClock, ranges: list[Range], title: str) -> str:
    """Final Cut Pro 7 XML (xmeml 4): a sequence at the source's rate and frame size with one clip item per
    kept range on the video track and, where the source has audio, on one audio track per channel
    (in/out are frames from the media's first frame, as the format counts them)."""
    E = ElementTree.Element
    sequence = E("sequence", id="sequence-1")
    clips = clip_frames(ranges, clock)
    record = from_timecode(RECORD_START, clock.rate, clock.drop_frame)
    _text(sequence, "name", title)
    _text(sequence, "duration", sum(end - first for first, end in clips))
    sequence.append(_rate_element(clock))
    sequence.append(_timecode(clock, record))
    media = ElementTree.SubElement(sequence, "media")
    video_node = ElementTree.SubElement(media, "video")
    video_node.append(_format(clock))
    tracks = [ElementTree.SubElement(video_node, "track")]
    if clock.audio_channels:
        audio_node = ElementTree.SubElement(media, "audio")
        _text(audio_node, "numOutputChannels", clock.audio_channels)
        tracks += [ElementTree.SubElement(audio_node, "track") for _ in range(clock.audio_channels)]
    start = 0
    for index, (first, end) in enumerate(clips, start=1):
        for number, track in enumerate(tracks):
            item = ElementTree.SubElement(track, "clipitem", id=f"clipitem-{index}-{number}")
            _text(item, "name", f"{Path(video).stem}_keep{index:03d}")
            _text(item, "duration", clock.frames)
            item.append(_rate_element(clock))
            for tag, value in (("start", start), ("end", start + end - first), ("in", first - clock.start_frame),
                               ("out", end - clock.start_frame)):
                _text(item, tag, value)
            item.append(_file(video, clock) if index == 1 and number == 0 else E("file", id="file-1"))
            if number:
                source = ElementTree.SubElement(item, "sourcetrack")
                _text(source, "mediatype", "audio")
                _text(source, "trackindex", number)
        start += end - first
    root = E("xmeml", version="4")
    root.append(sequence)
    ElementTree.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE xmeml>\n' + ElementTree.tostring(root, encoding="unicode") + "\n"


def _text(parent, tag: str, value) -> ElementTree.Element:
    node = ElementTree.SubElement(parent, tag)
    node.text = str(value)
    return node


def _rate_element(clock: MediaClock) -> ElementTree.Element:
    rate = ElementTree.Element("rate")
    _text(rate, "timebase", round(float(clock.rate)))
    _text(rate, "ntsc", "TRUE" if clock.rate.denominator == 1001 else "FALSE")
    return rate


def _timecode(clock: MediaClock, frame: int) -> ElementTree.Element:
    node = ElementTree.Element("timecode")
    node.append(_rate_element(clock))
    _text(node, "string", clock.timecode(frame))
    _text(node, "frame", frame)
    _text(node, "displayformat", "DF" if clock.drop_frame else "NDF")
    return node


def _format(clock: MediaClock) -> ElementTree.Element:
    """A format block: the source's frame size and rate, square pixels, progressive."""
    block = ElementTree.Element("format")
    block.append(_video_characteristics(clock))
    return block


def _video_characteristics(clock: MediaClock) -> ElementTree.Element:
    facts = ElementTree.Element("samplecharacteristics")
    facts.append(_rate_element(clock))
    for tag, value in (("width", clock.width), ("height", clock.height), ("anamorphic", "FALSE"),
                       ("pixelaspectratio", "square"), ("fielddominance", "none")):
        _text(facts, tag, value)
    return facts


def _file(video: Path, clock: MediaClock) -> ElementTree.Element:
    """The source file, once (later clip items name it by id): its URL, length, start timecode, video and audio."""
    file = ElementTree.Element("file", id="file-1")
    _text(file, "name", Path(video).name)
    _text(file, "pathurl", Path(video).resolve().as_uri())
    file.append(_rate_element(clock))
    _text(file, "duration", clock.frames)
    file.append(_timecode(clock, clock.start_frame))
    media = ElementTree.SubElement(file, "media")
    ElementTree.SubElement(media, "video").append(_video_characteristics(clock))
    if clock.audio_channels:
        audio = ElementTree.SubElement(media, "audio")
        facts = ElementTree.SubElement(audio, "samplecharacteristics")
        _text(facts, "depth", 16)
        _text(facts, "samplerate", clock.audio_rate)
        _text(audio, "channelcount", clock.audio_channels)
    return file


def write_timelines(video: Path, clock: MediaClock, ranges: list[Range], out: Path, stem: str, title: str) -> dict:
    """The cut as ``stem``.otio, .edl and .xml in ``out``; the files written."""
    import opentimelineio as otio

    out.mkdir(parents=True, exist_ok=True)
    written = {suffix: out / f"{stem}.{suffix}" for suffix in EDITOR_FILES}
    otio.adapters.write_to_file(otio_timeline(video, clock, ranges, title), str(written["otio"]),
                                adapter_name="otio_json")
    written["edl"].write_text(edl_text(video, clock, ranges, title))
    written["xml"].write_text(fcp_xml(video, clock, ranges, title))
    return {suffix: str(path) for suffix, path in written.items()}


EVENT = re.compile(r"^\d{3,}\s+\S+\s+\S+\s+C\s+(\S+)\s+(\S+)\s+\S+\s+\S+\s*$")


def read_ranges(path: Path, clock: MediaClock) -> list[Range]:
    """The kept ranges (player seconds) of an editor file written for ``clock``'s media: an EDL's events
    at the media's own rate, an XML's video clip items, an .otio's video clips."""
    path = Path(path)
    if path.suffix.lower() == ".edl":
        frames = [(from_timecode(a, clock.rate, clock.drop_frame), from_timecode(b, clock.rate, clock.drop_frame))
                  for line in path.read_text().splitlines() if (match := EVENT.match(line))
                  for a, b in [match.groups()]]
    elif path.suffix.lower() == ".xml":
        track = ElementTree.parse(path).getroot().find("sequence/media/video/track")
        frames = [(int(item.findtext("in")) + clock.start_frame, int(item.findtext("out")) + clock.start_frame)
                  for item in (track.iter("clipitem") if track is not None else [])]
    else:
        import opentimelineio as otio

        read = otio.adapters.read_from_file(str(path))
        video = next(track for track in read.tracks if track.kind == otio.schema.TrackKind.Video)
        frames = [(clip.source_range.start_time.rescaled_to(float(clock.rate)).value,
                   clip.source_range.end_time_exclusive().rescaled_to(float(clock.rate)).value)
                  for clip in video.find_clips()]
    return [(clock.seconds_at(round(a)), clock.seconds_at(round(b))) for a, b in frames]

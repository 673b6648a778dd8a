"""Frames by PyAV (a current FFmpeg), for the videos decord 0.6 cannot show as a player does.

decord bundles FFmpeg 4 (2018): it cannot open AV1 (what many downloaded web videos, newer phones
and screen recorders give), it rejects a whole MP4 that was cut off, though most of it decodes, and
it hands back interlaced frames with two instants woven together. :class:`PyAVReader` reads those
files with the same calls decord's reader answers (``len``, ``get_frame_timestamp``, ``get_batch``)
so that :class:`videosft.media.video.VideoFile` takes either, per file:

* frame times come from the packets' presentation times, counted from the first frame as decord
  counts them; a file cut off keeps the packets wholly inside it (the index of a cut MP4 still lists
  the rest) and says how far it decodes (:attr:`PyAVReader.decodable_seconds`);
* ``get_batch`` seeks to the keyframe before the first wanted frame and decodes forward;
* an interlaced stream (its field order says so) goes through FFmpeg's ``bwdif`` deinterlacer, one
  frame out per frame in, at the same time.

decord stays the first choice: every file it opens keeps today's frames and times, and it decoded the
preprocess stage's windows 1.9x faster than this reader (geometric mean over six files, 0.24-0.91x for
PyAV; bench/RESULTS.md, bench/video_readers.py).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

INTERLACED = {"tt", "bb", "tb", "bt"}  # FFmpeg's field orders other than progressive / unknown


@contextmanager
def ffmpeg_log():
    """FFmpeg's messages while PyAV reads a file, kept (this thread's) instead of printed among the
    stage's own lines: a reject quotes them (:func:`said`), otherwise they are dropped."""
    import av.logging

    if av.logging.get_level() is None:  # PyAV leaves FFmpeg printing to stderr unless a level is set
        av.logging.set_level(av.logging.WARNING)
    with av.logging.Capture() as logs:
        yield logs


def said(logs) -> str:
    """The last few distinct FFmpeg messages, for a reject's text."""
    lines = list(dict.fromkeys(message.strip() for _level, _name, message in logs if message.strip()))
    return f" (FFmpeg: {'; '.join(lines[-3:])})" if lines else ""


class Frames:
    """What ``get_batch`` returns: decord's shape, (N, H, W, 3) uint8 via ``asnumpy``."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def asnumpy(self) -> np.ndarray:
        return self.array


FIELD_ORDERS = {0: "unknown", 1: "progressive", 2: "tt", 3: "bb", 4: "tb", 5: "bt"}  # FFmpeg's AVFieldOrder


def field_order(stream) -> str:
    order = getattr(stream.codec_context, "field_order", None)
    if isinstance(order, int):
        return FIELD_ORDERS.get(order, "unknown")
    return str(getattr(order, "name", order) or "unknown").lower()


class PyAVReader:
    """decord's VideoReader calls, answered by PyAV (module docstring)."""

    def __init__(self, path: Path):
        import av

        self.path = Path(path)
        size = os.path.getsize(self.path)
        with ffmpeg_log() as logs:
            try:
                with av.open(str(self.path)) as container:
                    stream = container.streams.video[0]
                    self.time_base = stream.time_base
                    self.interlaced = field_order(stream) in INTERLACED
                    stated = container.duration / 1e6 if container.duration else None
                    packets = list(_packets(container, stream))
            except av.error.FFmpegError as error:
                raise ValueError(f"{error}{said(logs)}") from None
        whole = [(pts, duration) for pts, duration, pos, length in packets
                 if pos is None or pos < 0 or pos + length <= size]
        if len(whole) < 2:
            raise ValueError(f"{len(whole)} whole video packet(s) in the file{said(logs)}")
        whole.sort()
        self.pts = np.array([pts for pts, _ in whole], dtype=np.int64)
        if stated is not None and stated > (self.pts[-1] - self.pts[0]) * float(self.time_base) + 0.05:
            # cut off: the last whole packets may still need ones that are gone; keep what decodes
            decoded = self._decodes_from(int(self.pts[max(0, len(self.pts) - 64)]))
            whole = [(pts, duration) for pts, duration in whole if pts <= max(decoded, default=self.pts[0])]
            self.pts = np.array([pts for pts, _ in whole], dtype=np.int64)
        steps = np.diff(self.pts)
        last = whole[-1][1] or (int(np.median(steps)) if len(steps) else 1)
        self.ends = np.append(self.pts[1:], self.pts[-1] + last)
        start = self.pts[0]
        self.times = np.stack([(self.pts - start), (self.ends - start)], axis=1) * float(self.time_base)
        self.decodable_seconds = float(self.times[-1, 1])
        # the index (or header) states a length the packets do not reach: the file was cut off
        frame = float(np.median(steps)) * float(self.time_base) if len(steps) else 0.0
        self.cut_off = stated is not None and stated > self.decodable_seconds + max(2 * frame, 0.05)
        self.stated_seconds = stated if self.cut_off else self.decodable_seconds

    def _decodes_from(self, pts: int) -> set[int]:
        """The presentation times that decode from the keyframe before ``pts`` to where the file breaks off."""
        import av

        with ffmpeg_log(), av.open(str(self.path)) as container:
            stream = container.streams.video[0]
            container.seek(pts, stream=stream, backward=True, any_frame=False)
            return {frame.pts for frame in _decoded(container, stream) if frame.pts is not None}

    def __len__(self) -> int:
        return len(self.pts)

    def get_frame_timestamp(self, indices) -> np.ndarray:
        return self.times[np.asarray(indices)]

    def get_avg_fps(self) -> float:
        return (len(self.pts) - 1) / max(float(self.times[-1, 0]), 1e-9)

    def get_batch(self, indices) -> Frames:
        """The frames at ``indices`` (any order, repeats allowed) as (N, H, W, 3) RGB."""
        import av

        wanted = {int(self.pts[i]) for i in indices}
        found: dict[int, np.ndarray] = {}
        with ffmpeg_log() as logs, av.open(str(self.path)) as container:
            stream = container.streams.video[0]
            container.seek(min(wanted), stream=stream, backward=True, any_frame=False)
            for frame in _deinterlaced(container, stream) if self.interlaced else _decoded(container, stream):
                # in the stream's time base (the deinterlacer's output counts in half its units)
                pts = None if frame.pts is None else round(frame.pts * frame.time_base / self.time_base)
                if pts in wanted:
                    found[pts] = frame.to_ndarray(format="rgb24")
                if pts is not None and pts >= max(wanted) or len(found) == len(wanted):
                    break
        missing = sorted(wanted - set(found))
        if missing:
            raise ValueError(f"{len(missing)} of the wanted frames did not decode (first at "
                             f"{(missing[0] - self.pts[0]) * float(self.time_base):.3f} s){said(logs)}")
        return Frames(np.stack([found[int(self.pts[i])] for i in indices]))


def _packets(container, stream):
    """(pts, duration, byte position, size) of each video packet, until the file ends or breaks off."""
    import av

    try:
        for packet in container.demux(stream):
            if packet.pts is not None and packet.size:
                yield packet.pts, packet.duration or 0, packet.pos, packet.size
    except (av.error.EOFError, av.error.InvalidDataError):
        return


def _decoded(container, stream):
    """Decoded frames from the current position; a file that breaks off ends them."""
    import av

    try:
        yield from container.decode(stream)
    except (av.error.EOFError, av.error.InvalidDataError):
        return


def _deinterlaced(container, stream):
    """Decoded frames through bwdif (one frame per frame, field order from the stream), same times."""
    import av

    graph = av.filter.Graph()
    source = graph.add_buffer(template=stream)
    deinterlace = graph.add("bwdif", "mode=send_frame:parity=auto:deint=all")
    sink = graph.add("buffersink")
    source.link_to(deinterlace)
    deinterlace.link_to(sink)
    graph.configure()
    def then_flush():
        yield from _decoded(container, stream)
        yield None  # tells bwdif the stream ended, so it gives back its last frame

    for frame in then_flush():
        graph.push(frame)
        while True:
            try:
                yield graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break

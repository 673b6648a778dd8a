"""The cut itself: a new video of only the kept ranges, for a look without an editor.

Frames are taken on the player's clock (:class:`videosft.media.video.VideoFile`'s timestamps, edit lists
applied) and re-encoded with H.264 at the source's display size in square pixels (a source with
non-square pixels is resized, as a player shows it), at the timeline's exact rate
(:mod:`videosft.media.clock`: 30000/1001, not 30) so that the cut is as long as its ranges. A variable-rate
source keeps each frame's own duration (time base 1/90000), so its cut is as long as its ranges too.
The audio is left out (the timelines keep the source, with its audio, for an editor).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

from .clock import MediaClock
from .timeline import Range
from .video import VideoFile

FINE = Fraction(1, 90000)  # the time base of a variable-rate cut, MPEG's clock


def render_cut(source: Path, ranges: list[Range], out: Path, clock: MediaClock, chunk: int = 64) -> Path | None:
    """Write the frames of ``source`` whose presentation time falls in ``ranges``, in order, to
    ``out``; None (and no file) when nothing is kept."""
    import av

    video = VideoFile(source)
    indices = np.concatenate([video.window_frames(start, end) for start, end in ranges]) if ranges else []
    if len(indices) == 0:
        return None
    variable = clock.rate_rule.startswith("variable")
    durations = frame_durations(video.timestamps, video.duration)
    out.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out), mode="w") as container:
        stream = container.add_stream("libx264", rate=clock.rate)
        stream.codec_context.time_base = FINE if variable else 1 / clock.rate
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        shown = Fraction(0)
        for first in range(0, len(indices), chunk):
            batch = [int(i) for i in indices[first:first + chunk]]
            frames = square_pixels(video, video.frames(batch))
            if first == 0:  # H.264 in yuv420p needs even sides
                stream.height, stream.width = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
            for index, array in zip(batch, frames):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array[:stream.height, :stream.width]),
                                                   format="rgb24")
                frame.time_base = stream.codec_context.time_base
                frame.pts = round(shown / frame.time_base)
                shown += Fraction(durations[index]).limit_denominator(90000) if variable else 1 / clock.rate
                for packet in stream.encode(frame):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out


def frame_durations(timestamps: np.ndarray, end: float) -> np.ndarray:
    """How long each frame shows: until the next one, the last until the video's end."""
    return np.diff(np.append(timestamps, max(end, timestamps[-1] + 1e-3)))


def square_pixels(video: VideoFile, frames: np.ndarray) -> np.ndarray:
    """Frames (N, H, W, 3) of a source with non-square pixels resized to its display size, square pixels
    (players and editors show the cut as they show the source)."""
    height, width = video.display_size(frames.shape[1], frames.shape[2])
    if width == frames.shape[2]:
        return frames
    import torch
    from torchvision.transforms.v2 import functional as tvf

    resized = tvf.resize(torch.from_numpy(frames).permute(0, 3, 1, 2), [height, width],
                         interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
    return resized.permute(0, 2, 3, 1).contiguous().numpy()

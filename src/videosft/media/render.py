"""The cut itself: a new video of only the kept ranges, for a look without an editor.

Frames are taken on the player's clock (:class:`videosft.media.video.VideoFile`'s timestamps, edit lists
applied) and re-encoded with H.264 at the source's frame size and average rate; the audio is left
out (the cut list keeps the source for an editor, who has it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .timeline import Range
from .video import VideoFile


def render_cut(source: Path, ranges: list[Range], out: Path, chunk: int = 64) -> Path | None:
    """Write the frames of ``source`` whose presentation time falls in ``ranges``, in order, to
    ``out``; None (and no file) when nothing is kept."""
    import av

    video = VideoFile(source)
    indices = np.concatenate([video.window_frames(start, end) for start, end in ranges]) if ranges else []
    if len(indices) == 0:
        return None
    rate = max(1, round(float(video.reader.get_avg_fps())))
    out.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out), mode="w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for first in range(0, len(indices), chunk):
            frames = video.reader.get_batch([int(i) for i in indices[first:first + chunk]]).asnumpy()
            if first == 0:  # H.264 in yuv420p needs even sides
                stream.height, stream.width = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
            for array in frames:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array[:stream.height, :stream.width]),
                                                   format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out

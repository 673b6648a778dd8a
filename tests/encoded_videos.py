"""Videos the tests encode with PyAV, as people have them: non-square pixels, AV1, interlaced footage."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np


def circle_video(path: Path, codec: str, coded: tuple[int, int], pixel_aspect: Fraction, frames: int = 12) -> Path:
    """A white circle on black, round on a player's screen: drawn narrower in coded pixels by the pixel
    aspect ratio, which the stream then declares."""
    import av

    height, width = coded
    display_width = width * pixel_aspect
    y, x = np.mgrid[0:height, 0:width]
    inside = ((x + 0.5) * pixel_aspect - display_width / 2) ** 2 + (y + 0.5 - height / 2) ** 2 < (0.35 * height) ** 2
    image = np.where(inside[..., None], 255, 0).astype(np.uint8).repeat(3, axis=2)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if pixel_aspect != 1:
            stream.codec_context.sample_aspect_ratio = pixel_aspect
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def bars_video(path: Path, codec: str = "libx264", frames: int = 48, woven: bool = False, options: dict | None = None,
               mux: dict | None = None, size: tuple[int, int] = (96, 128)) -> Path:
    """A bar moving right 3 pixels a frame; ``woven``: odd rows half a frame later, as interlaced footage
    is (each field its own instant), encoded as interlaced top-field-first H.264."""
    import av

    height, width = size
    with av.open(str(path), "w", options=mux or {}) as container:
        stream = container.add_stream(codec, rate=24)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        stream.options = {"x264-params": "interlaced=1:tff=1"} if woven else (options or {})
        for index in range(frames):
            image = np.zeros((height, width, 3), np.uint8)
            x = (index * 3) % (width - 16)
            image[0::2, x:x + 12] = 255
            image[1::2, x + (6 if woven else 0):x + (18 if woven else 12)] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path

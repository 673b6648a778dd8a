"""Synthetic videos with known answers: a moving background and a red ball that is visible during one
or two intervals, whose visible intervals are the video's keep ranges.

:func:`make_videos` writes the videos and their annotations; :func:`render_frames` draws any frames
of such a video (the pretraining renders its clips with it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import View

QUERY = "the red ball"


def visible_intervals(rng: np.random.Generator, n_frames: int, fps: int) -> list[tuple[int, int]]:
    """One or two frame intervals [a, b) in which the ball is visible, on whole seconds.

    Whole seconds keep the answers on the same grid as the sampled frame pairs (at the default
    2 fps, one pair per second), so a keep range is decidable from what the model sees.
    """
    seconds = n_frames // fps
    count = int(rng.integers(1, 3))
    bounds = np.sort(rng.choice(np.arange(1, seconds), size=2 * count, replace=False)) * fps
    return [(int(bounds[2 * i]), int(bounds[2 * i + 1])) for i in range(count)]


def render_frames(rng: np.random.Generator, cfg: View, intervals: list[tuple[int, int]],
                  n_frames: int | None = None, indices: list[int] | None = None) -> np.ndarray:
    """Frames ``indices`` (default: all) of a video of ``n_frames`` (default: the demo's length)."""
    height, width = cfg.height, cfg.width
    n_frames = n_frames or int(round(cfg.seconds * cfg.fps))
    indices = range(n_frames) if indices is None else indices
    yy, xx = np.mgrid[0:height, 0:width]
    base_color = rng.uniform(40, 110, size=3) * np.array([0.6, 1.0, 1.0])  # never red: the ball is
    frames = np.empty((len(indices), height, width, 3), dtype=np.uint8)
    radius = max(3, height // 4)
    for slot, index in enumerate(indices):
        phase = 2 * np.pi * index / n_frames
        shade = 30 * np.sin(xx / width * 2 * np.pi + phase)[..., None]
        frame = np.clip(base_color + shade + rng.normal(0, 4, size=(height, width, 3)), 0, 255)
        if any(a <= index < b for a, b in intervals):
            cx = radius + (width - 2 * radius) * (0.5 + 0.45 * np.sin(phase * 3))
            cy = height / 2 + (height / 4) * np.cos(phase * 2)
            disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
            frame[disc] = (230, 30, 30)
        frames[slot] = frame.astype(np.uint8)
    return frames


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        # x264's AVX-512 code (chosen on CPUs that have it) encodes the same frames to other pixels
        # from run to run when the machine is loaded: the demo's data, and so what the learning
        # test's fine-tune scores, changed between runs of one commit. Its plain C code repeats
        # itself on every CPU, for about 0.1 s more per demo video (bench/RESULTS.md).
        stream.options = {"crf": "18", "preset": "veryfast", "x264-params": "asm=0"}
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_videos(cfg: View, video_dir: Path, annotations: Path) -> list[dict]:
    """``cfg.videos`` videos (``cfg``: the demo section) under ``video_dir``, and their annotations as JSONL."""
    rng = np.random.default_rng(cfg.seed)
    rows = []
    n_frames = int(round(cfg.seconds * cfg.fps))
    for index in range(cfg.videos):
        intervals = visible_intervals(rng, n_frames, cfg.fps)
        name = f"video_{index:03d}.mp4"
        write_mp4(video_dir / name, render_frames(rng, cfg, intervals), cfg.fps)
        keep = [[a / cfg.fps, b / cfg.fps] for a, b in intervals]
        rows.append({"video": name, "query": QUERY, "keep": keep})
    annotations.parent.mkdir(parents=True, exist_ok=True)
    annotations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows

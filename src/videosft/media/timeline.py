"""A video's timeline: the windows that cover it, ranges on it and in a window's own time, and
where its file is.

Shared by the stages that cut videos into windows (window, and predict for new videos), so that a
window means the same span wherever it is made.

A keep range ``[s, e]`` in source seconds becomes ``[s - w0, e - w0]`` in a window that starts at
``w0`` (:func:`realign`); a range that crosses a window edge is clipped to the window, and a
fragment shorter than a minimum after clipping is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Rejected

Range = tuple[float, float]


def window_bounds(duration: float, length: float, stride: float, tail: str = "shift") -> list[Range]:
    """Window ``[start, end]`` pairs covering ``[0, duration]``.

    ``tail`` decides a last window that would run past the end: ``shift`` moves it left to end
    at ``duration``, ``short`` keeps it shorter than ``length``, ``drop`` leaves it out. A video
    shorter than one window gives one window ``[0, duration]`` unless ``tail`` is ``drop``.
    """
    if duration <= 0 or not math.isfinite(duration):
        raise ValueError(f"duration must be a positive number, got {duration}")
    bounds: list[Range] = []
    index = 0
    # every start from its index (never accumulated), every end clamped to the video's end
    while (start := index * stride) + length <= duration + 1e-9:
        bounds.append((start, min(start + length, duration)))
        index += 1
    covered = bounds[-1][1] if bounds else 0.0
    if covered < duration - 1e-9 and tail != "drop":
        last = (max(0.0, duration - length), duration) if tail == "shift" else (start, duration)
        if not bounds or last != bounds[-1]:
            bounds.append(last)
    return bounds


def merge_ranges(ranges: list[Range]) -> tuple[list[Range], int]:
    """Sort and merge overlapping or touching ranges; return them and how many merges happened."""
    merged: list[list[float]] = []
    merges = 0
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            merges += 1
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged], merges


@dataclass
class Realigned:
    """A window's share of the keep ranges, in window time (``local``) and source time, with how many
    ranges its edges clipped and the fragments dropped as too short."""
    local: list[Range]
    source: list[Range]
    clipped: int = 0
    dropped: list[Range] = field(default_factory=list)


def realign(keep: list[Range], start: float, end: float, min_fragment: float) -> Realigned:
    """Clip ``keep`` (source seconds) to ``[start, end]`` and express it in window time."""
    result = Realigned(local=[], source=[])
    for keep_start, keep_end in keep:
        if keep_end <= start or keep_start >= end:
            continue
        clipped_start, clipped_end = max(keep_start, start), min(keep_end, end)
        if (clipped_start, clipped_end) != (keep_start, keep_end):
            result.clipped += 1
        if clipped_end - clipped_start < min_fragment:
            result.dropped.append((clipped_start, clipped_end))
            continue
        result.source.append((clipped_start, clipped_end))
        result.local.append((clipped_start - start, clipped_end - start))
    return result


def resolve_video(root: Path, relative: str) -> Path:
    """The video's path under ``root``; paths that leave the root are refused."""
    candidate = Path(relative)
    if candidate.is_absolute():
        raise Rejected("video_outside_root", f"video path {relative!r} is absolute; give it relative to data.root "
                       f"({root})")
    resolved = (root / candidate).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise Rejected("video_outside_root", f"video path {relative!r} leaves data.root ({root})")
    return resolved

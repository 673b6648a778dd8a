"""The user's annotation file: one JSON line per video (and query) saying what to keep, its formats
and the checks every line passes.

Formats (``data.format``): ``videosft`` (``video``, optional ``query``, ``id``, ``duration``, and
``keep``) and ``qvhighlights`` (``vid``, ``query``, ``qid``, ``duration``, ``relevant_windows``;
the video file is ``vid`` + ``data.video_suffix``). A video's duration comes from its container, or
with ``data.duration: annotation`` from the line (the videos are then not opened).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..config import View
from ..media.timeline import Range, resolve_video
from ..media.video import VideoFile
from ..errors import Rejected
from .rejects import Rejects


def _checked_ranges(ranges, field: str) -> list[Range]:
    if not isinstance(ranges, list):
        raise Rejected("bad_keep_range", f'"{field}" must be a list of [start, end] pairs')
    checked = []
    for pair in ranges:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)):
            raise Rejected("bad_keep_range", f"keep range {pair!r} is not a [start, end] pair of numbers")
        try:
            start, end = float(pair[0]), float(pair[1])
        except OverflowError:
            raise Rejected("bad_keep_range", f"keep range {pair!r} has a time too large to be seconds") from None
        if not (math.isfinite(start) and math.isfinite(end)):
            raise Rejected("bad_keep_range", f"keep range {pair!r} has a non-finite time")
        if start < 0:
            raise Rejected("bad_keep_range", f"keep range {pair!r} starts before 0")
        if start >= end:
            raise Rejected("bad_keep_range", f"keep range {pair!r} has start >= end")
        checked.append((start, end))
    return checked


def parse_annotation(line: str, data_cfg: View) -> dict:
    """One JSONL line as ``{video, query, id, keep, duration}``, checked (formats: the module docstring)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise Rejected("not_json", f"not valid JSON ({error.msg} at column {error.colno})") from None
    if data_cfg.format == "qvhighlights":
        if not isinstance(row, dict) or not isinstance(row.get("vid"), str):
            raise Rejected("bad_fields", 'needs an object with a string "vid"')
        video, keep, key, id_key = row["vid"] + data_cfg.video_suffix, row.get("relevant_windows"), "relevant_windows", "qid"
    else:
        if not isinstance(row, dict) or not isinstance(row.get("video"), str):
            raise Rejected("bad_fields", 'needs an object with a string "video"')
        video, keep, key, id_key = row["video"], row.get("keep", []), "keep", "id"
    query = row.get("query")
    if query is not None and not isinstance(query, str):
        raise Rejected("bad_fields", '"query" must be a string')
    duration = row.get("duration")
    if duration is not None and not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise Rejected("bad_fields", f'"duration" {duration!r} must be a positive number of seconds')
    return {"video": video, "query": query, "id": row.get(id_key), "duration": duration,
            "keep": _checked_ranges(keep, key)}


def annotation_duration(ann: dict, root: Path, data_cfg: View) -> float:
    """Seconds of the video: from the container, or from the annotation (videos not opened)."""
    if data_cfg.duration == "annotation":
        if ann["duration"] is None:
            raise Rejected("no_duration", 'data.duration is "annotation" but the line has no "duration"; add it, or '
                           "set data.duration: container to read it from the video")
        return float(ann["duration"])
    path = resolve_video(root, ann["video"])
    if not path.exists():
        raise Rejected("video_missing", f"video {path} does not exist")
    return VideoFile(path).duration


def read_annotations(annotations: Path, root: Path, data_cfg: View, rejects: Rejects) -> list[tuple[dict, float]]:
    """Every good line of the file with its video's duration in seconds; a bad line (not parseable, a
    second line for the same video and query, a video outside ``root`` or missing, keep ranges past
    the video's end) goes to ``rejects`` with its file and line number."""
    checked = []
    seen: set[tuple[str, str | None]] = set()
    for line_number, line in enumerate(annotations.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        ann = None
        try:
            ann = parse_annotation(line, data_cfg)
            key = (ann["video"], ann["query"])
            if key in seen:
                raise Rejected("duplicate", f"duplicate entry for video {ann['video']!r} and query {ann['query']!r}")
            seen.add(key)
            resolve_video(root, ann["video"])
            duration = annotation_duration(ann, root, data_cfg)
            late = [r for r in ann["keep"] if r[1] > duration + 1e-3]
            if late:
                raise Rejected("keep_after_end", f"keep ranges {late} end after the video's duration {duration:.3f} s")
        except Exception as error:  # one bad line never loses the others
            rejects.add(f"{annotations}:{line_number}", error, video=ann and ann["video"])
            continue
        checked.append((ann, duration))
    return checked

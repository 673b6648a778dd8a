"""The user's annotation file: one JSON line per video (and query) saying what to keep, its formats
and the checks every line passes.

Formats (``data.format``): ``videosft`` (``video``, optional ``query``, ``id``, ``duration``,
``source``, and ``keep``) and ``qvhighlights`` (``vid``, ``query``, ``qid``, ``duration``,
``relevant_windows``; the video file is ``vid`` + ``data.video_suffix``). A video's duration comes
from its container, or with ``data.duration: annotation`` from the line (the videos are then not
opened).

Each line also names its *source*: the recording its video was cut from, which the train / val
split keeps whole (clips of one recording on both sides would score near-duplicate footage). It is
the line's ``source`` when given; else, for ``videosft``, the ``video`` path (each file its own
recording), and for ``qvhighlights`` the YouTube id of the clip id ``<youtube id>_<start>_<end>``
(:func:`qvhighlights_source`). All lines of one video must name the same source.
"""

from __future__ import annotations

import json
import math
import re
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


# What the split key (the source) is, per format: the window stage records it beside its counts.
SOURCE_RULES = {
    "videosft": 'the line\'s "source", else its "video" path',
    "qvhighlights": 'the line\'s "source", else the YouTube id: "vid" without its "_<start>_<end>"',
}

# A QVHighlights clip id: the YouTube id, then the clip's start and end in the YouTube video's seconds
# (``-4Mlqc7PbZY_210.0_360.0``). YouTube ids themselves hold "_" and "-" (``2vFzBa_WKNg``), so the
# two numbers are taken off the end (the greedy ``.+`` leaves exactly them), never split from the front.
QVHIGHLIGHTS_CLIP = re.compile(r"(?P<youtube_id>.+)_(?P<start>\d+(?:\.\d+)?)_(?P<end>\d+(?:\.\d+)?)")


def qvhighlights_source(vid: str) -> str:
    """The YouTube id of a QVHighlights clip id: ``-4Mlqc7PbZY_210.0_360.0`` -> ``-4Mlqc7PbZY``."""
    match = QVHIGHLIGHTS_CLIP.fullmatch(vid)
    if match is None:
        raise Rejected("bad_fields", f'"vid" {vid!r} is not <youtube id>_<start>_<end>, so the video it was cut '
                       'from is unknown and the train / val split cannot keep it whole; add a "source" field '
                       "naming that video to the line")
    return match["youtube_id"]


def _source(row: dict, default) -> str:
    """The line's ``source`` (the recording its video was cut from), else ``default()``."""
    if "source" not in row:
        return default()
    if not isinstance(row["source"], str) or not row["source"].strip():
        raise Rejected("bad_fields", f'"source" {row["source"]!r} must be a non-empty string naming the recording '
                       "the video was cut from (leave it out when each video is its own recording)")
    return row["source"]


def parse_annotation(line: str, data_cfg: View) -> dict:
    """One JSONL line as ``{video, query, id, keep, duration, source}``, checked (formats and the
    source: the module docstring)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise Rejected("not_json", f"not valid JSON ({error.msg} at column {error.colno})") from None
    if data_cfg.format == "qvhighlights":
        if not isinstance(row, dict) or not isinstance(row.get("vid"), str):
            raise Rejected("bad_fields", 'needs an object with a string "vid"')
        video, keep, key, id_key = row["vid"] + data_cfg.video_suffix, row.get("relevant_windows"), "relevant_windows", "qid"
        source = _source(row, lambda: qvhighlights_source(row["vid"]))
    else:
        if not isinstance(row, dict) or not isinstance(row.get("video"), str):
            raise Rejected("bad_fields", 'needs an object with a string "video"')
        video, keep, key, id_key = row["video"], row.get("keep", []), "keep", "id"
        source = _source(row, lambda: row["video"])
    query = row.get("query")
    if query is not None and not isinstance(query, str):
        raise Rejected("bad_fields", '"query" must be a string')
    duration = row.get("duration")
    if duration is not None and not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise Rejected("bad_fields", f'"duration" {duration!r} must be a positive number of seconds')
    return {"video": video, "query": query, "id": row.get(id_key), "duration": duration,
            "keep": _checked_ranges(keep, key), "source": source}


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


def _check_one_source(ann: dict, first: tuple[str, int]) -> None:
    """A video's lines all name one source: the split goes by source, so a video with two could have
    windows on both sides."""
    source, line_number = first
    if ann["source"] != source:
        raise Rejected("bad_fields", f'video {ann["video"]!r} has "source" {ann["source"]!r} here but {source!r} on '
                       f'line {line_number}; give every line of one video the same "source"')


def read_annotations(annotations: Path, root: Path, data_cfg: View, rejects: Rejects) -> list[tuple[dict, float]]:
    """Every good line of the file with its video's duration in seconds; a bad line (not parseable, a
    second line for the same video and query, a video outside ``root`` or missing, keep ranges past
    the video's end, a source other than an earlier line's for the same video) goes to ``rejects``
    with its file and line number."""
    checked = []
    seen: set[tuple[str, str | None]] = set()
    sources: dict[str, tuple[str, int]] = {}  # video -> (its source, the line that named it)
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
            _check_one_source(ann, sources.setdefault(ann["video"], (ann["source"], line_number)))
        except Exception as error:  # one bad line never loses the others
            rejects.add(f"{annotations}:{line_number}", error, video=ann and ann["video"])
            continue
        checked.append((ann, duration))
    return checked

"""Stage 1, window: cut long videos into windows and move keep ranges into window time.

A keep range ``[s, e]`` in source seconds becomes ``[s - w0, e - w0]`` in a window that starts at
``w0``; a range that crosses a window edge is clipped to the window, and a fragment shorter than
``window.min_fragment`` after clipping is dropped and counted. Videos are split into train / val
as wholes, from a hash of the seed and the video path, so the split does not depend on the order
of the annotation file.

    python -m videosft.stages.window --config config.yaml --out results/window
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .. import config as config_lib
from ..provenance import exit_after, run_record, stage_parser, write_json
from ..config import View
from ..data.rejects import Rejects
from ..media.timeline import Range, merge_ranges, resolve_video, window_bounds
from ..media.video import VideoFile

WINDOW_SCHEMA = pa.schema(
    [
        ("window_id", pa.string()),
        ("video", pa.string()),
        ("query", pa.string()),
        ("split", pa.string()),
        ("video_duration", pa.float64()),
        ("window_index", pa.int32()),
        ("window_start", pa.float64()),
        ("window_end", pa.float64()),
        ("keep_source", pa.list_(pa.list_(pa.float64(), 2))),
        ("keep_local", pa.list_(pa.list_(pa.float64(), 2))),
    ]
)


@dataclass
class Realigned:
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


def assign_splits(videos: list[str], val_fraction: float, seed: int) -> dict[str, str]:
    """'val' for the ``round(val_fraction * n)`` videos with the smallest seeded hash, else 'train'.

    At least one video goes to each split when there are two or more and ``val_fraction > 0``.
    """
    ranked = sorted(set(videos), key=lambda name: _video_hash(name, seed))
    n_val = round(val_fraction * len(ranked))
    if val_fraction > 0 and len(ranked) >= 2:
        n_val = min(max(n_val, 1), len(ranked) - 1)
    return {video: "val" if rank < n_val else "train" for rank, video in enumerate(ranked)}


def _video_hash(video: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{video}".encode()).hexdigest()


def _checked_ranges(ranges, field: str) -> list[Range]:
    if not isinstance(ranges, list):
        raise ValueError(f'"{field}" must be a list of [start, end] pairs')
    checked = []
    for pair in ranges:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)):
            raise ValueError(f"keep range {pair!r} is not a [start, end] pair of numbers")
        try:
            start, end = float(pair[0]), float(pair[1])
        except OverflowError:
            raise ValueError(f"keep range {pair!r} has a time too large to be seconds") from None
        if not (math.isfinite(start) and math.isfinite(end)):
            raise ValueError(f"keep range {pair!r} has a non-finite time")
        if start < 0:
            raise ValueError(f"keep range {pair!r} starts before 0")
        if start >= end:
            raise ValueError(f"keep range {pair!r} has start >= end")
        checked.append((start, end))
    return checked


def parse_annotation(line: str, data_cfg: View) -> dict:
    """One JSONL line as ``{video, query, id, keep, duration}``, checked.

    Formats: ``videosft`` (``video``, optional ``query``, ``id``, ``duration``, and ``keep``) and
    ``qvhighlights`` (``vid``, ``query``, ``qid``, ``duration``, ``relevant_windows``; the video file
    is ``vid`` + ``data.video_suffix``).
    """
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    if data_cfg.format == "qvhighlights":
        if not isinstance(row, dict) or not isinstance(row.get("vid"), str):
            raise ValueError('needs an object with a string "vid"')
        video, keep, key, id_key = row["vid"] + data_cfg.video_suffix, row.get("relevant_windows"), "relevant_windows", "qid"
    else:
        if not isinstance(row, dict) or not isinstance(row.get("video"), str):
            raise ValueError('needs an object with a string "video"')
        video, keep, key, id_key = row["video"], row.get("keep", []), "keep", "id"
    query = row.get("query")
    if query is not None and not isinstance(query, str):
        raise ValueError('"query" must be a string')
    duration = row.get("duration")
    if duration is not None and not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise ValueError(f'"duration" {duration!r} must be a positive number of seconds')
    return {"video": video, "query": query, "id": row.get(id_key), "duration": duration,
            "keep": _checked_ranges(keep, key)}


def window_id(ann: dict, index: int) -> str:
    """``video#index``, plus the query's id (or a short hash of its text) when there is a query."""
    base = f"{ann['video']}#{index:04d}"
    if ann["id"] is not None:
        return f"{base}/{ann['id']}"
    if ann["query"]:
        return f"{base}/{hashlib.sha256(ann['query'].encode()).hexdigest()[:8]}"
    return base


def annotation_duration(ann: dict, root: Path, data_cfg: View) -> float:
    """Seconds of the video: from the container, or from the annotation (videos not opened)."""
    if data_cfg.duration == "annotation":
        if ann["duration"] is None:
            raise ValueError('data.duration is "annotation" but the line has no "duration"')
        return float(ann["duration"])
    path = resolve_video(root, ann["video"])
    if not path.exists():
        raise FileNotFoundError(f"video {path} does not exist")
    return VideoFile(path).duration


def limit_empty_windows(rows: list[dict], max_fraction: float, seed: int) -> list[dict]:
    """Drop windows with nothing to keep beyond ``max_fraction`` of each split, chosen by seeded hash."""
    if max_fraction >= 1:
        return rows
    kept = []
    for split in ("train", "val"):
        in_split = [row for row in rows if row["split"] == split]
        empty = sorted((r for r in in_split if not r["keep_local"]),
                       key=lambda r: _video_hash(r["window_id"], seed))
        allowed = math.floor(max_fraction / (1 - max_fraction) * (len(in_split) - len(empty)) + 1e-9)
        dropped = {id(r) for r in empty[allowed:]}
        kept += [row for row in in_split if id(row) not in dropped]
    return sorted(kept, key=lambda row: (row["video"], row["window_index"], row["window_id"]))


def build_windows(annotations: Path, root: Path, cfg: View, rejects: Rejects) -> tuple[list[dict], Counter]:
    wcfg, data_cfg = cfg.window, cfg.data
    counts: Counter = Counter()
    rows = []
    seen: set[tuple[str, str | None]] = set()
    for line_number, line in enumerate(annotations.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{annotations}:{line_number}"
        ann = None
        try:
            ann = parse_annotation(line, data_cfg)
            key = (ann["video"], ann["query"])
            if key in seen:
                raise ValueError(f"duplicate entry for video {ann['video']!r} and query {ann['query']!r}")
            seen.add(key)
            resolve_video(root, ann["video"])
            duration = annotation_duration(ann, root, data_cfg)
            late = [r for r in ann["keep"] if r[1] > duration + 1e-3]
            if late:
                raise ValueError(f"keep ranges {late} end after the video's duration {duration:.3f} s")
        except Exception as error:  # one bad line never loses the others
            rejects.add(where, error, video=ann and ann["video"])
            continue
        keep, merges = merge_ranges(ann["keep"])
        counts["annotations"] += 1
        counts["keep_ranges"] += len(ann["keep"])
        counts["keep_merged"] += merges
        bounds = window_bounds(duration, wcfg.length, wcfg.stride, wcfg.tail)
        for index, (start, end) in enumerate(bounds):
            aligned = realign(keep, start, end, wcfg.min_fragment)
            counts["fragments_clipped"] += aligned.clipped
            counts["fragments_dropped"] += len(aligned.dropped)
            rows.append(
                {
                    "window_id": window_id(ann, index),
                    "video": ann["video"],
                    "query": ann["query"],
                    "video_duration": duration,
                    "window_index": index,
                    "window_start": start,
                    "window_end": end,
                    "keep_source": [list(r) for r in aligned.source],
                    "keep_local": [list(r) for r in aligned.local],
                }
            )
    splits = assign_splits([row["video"] for row in rows], wcfg.val_fraction, wcfg.seed)
    for row in rows:
        row["split"] = splits[row["video"]]
    counts["windows_made"] = len(rows)
    counts["windows_empty_made"] = sum(not row["keep_local"] for row in rows)
    rows = limit_empty_windows(rows, wcfg.max_empty_fraction, wcfg.seed)
    counts["windows"] = len(rows)
    counts["windows_empty"] = sum(not row["keep_local"] for row in rows)
    counts["windows_empty_dropped"] = counts["windows_empty_made"] - counts["windows_empty"]
    for row in rows:
        counts[f"windows_{row['split']}"] += 1
    counts["videos"] = len(splits)
    counts["videos_val"] = sum(split == "val" for split in splits.values())
    counts["videos_train"] = sum(split == "train" for split in splits.values())
    return rows, counts


def write_windows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=WINDOW_SCHEMA)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "window")
    with run_record("window", args.out, cfg, args) as record:
        rejects = Rejects(args.out / "rejects.jsonl")
        rows, counts = build_windows(Path(cfg.data.annotations), Path(cfg.data.root), cfg, rejects)
        write_windows(rows, args.out / "windows.parquet")
        record["results"] = {"counts": dict(counts), "rejects": rejects.summary()}
        write_json(args.out / "summary.json", record["results"])
        print(f"window: {counts['windows']} windows from {counts['annotations']} annotations of {counts['videos']} "
              f"videos ({counts['windows_train']} train, {counts['windows_val']} val, {counts['windows_empty']} with "
              f"nothing to keep, {counts['windows_empty_dropped']} more of those dropped); {counts['keep_merged']} "
              f"keep ranges merged, {counts['fragments_clipped']} clipped at window edges, "
              f"{counts['fragments_dropped']} fragments shorter than window.min_fragment dropped; "
              f"{len(rejects)} lines rejected")
        rejects.check(cfg.data.max_reject_fraction, total=counts["annotations"] + len(rejects),
                      what="annotation lines")
    return 0


if __name__ == "__main__":
    exit_after(main)

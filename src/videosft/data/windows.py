"""``windows.parquet``: the window stage's windows, which the preprocess and predict stages read; and a new
video's windows, which the predict stage cuts by the same rules (:func:`new_video_windows`).

One row per window of a video (and query) (:data:`WINDOW_SCHEMA`, made by :func:`window_row`): its
span in source seconds and the keep ranges inside it, in source and in window time. Here too what
decides the rows' ``split`` and which rows there are: source videos (the recordings the videos were
cut from, :mod:`videosft.data.annotations`) go to train or val as wholes, with all their videos,
from a seeded hash of the source (:func:`assign_splits`, so the split does not depend on the order
of the annotation file; :func:`check_sources_whole` proves none straddles), and windows with
nothing to keep are held to a share of each split (:func:`limit_empty_windows`); and how the
preprocess stage deals the windows to its shards, by video (:func:`video_shards`).
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..media.timeline import Range, resolve_video, window_bounds

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


def window_row(window_id: str, video: str, query: str | None, split: str | None, duration: float, index: int,
               bounds: Range, keep_source: Iterable[Range] = (), keep_local: Iterable[Range] = ()) -> dict:
    """One window as a row of :data:`WINDOW_SCHEMA`: ``bounds`` and ``keep_source`` in source seconds,
    ``keep_local`` in window time."""
    start, end = bounds
    return {"window_id": window_id, "video": video, "query": query, "split": split, "video_duration": duration,
            "window_index": index, "window_start": start, "window_end": end,
            "keep_source": [list(r) for r in keep_source], "keep_local": [list(r) for r in keep_local]}


def new_video_windows(name: str, duration: float, query: str, window_cfg) -> list[dict]:
    """A new video's windows (the predict stage's), by the window stage's rules (``window_cfg``: its
    section): a ``drop`` tail is read as ``shift``, so that no second goes unjudged."""
    tail = "shift" if window_cfg.tail == "drop" else window_cfg.tail
    return [window_row(f"{name}#{index}", name, query, "predict", duration, index, bounds)
            for index, bounds in enumerate(window_bounds(duration, window_cfg.length, window_cfg.stride, tail))]


def window_id(ann: dict, index: int) -> str:
    """``video#index``, plus the query's id (or a short hash of its text) when there is a query."""
    base = f"{ann['video']}#{index:04d}"
    if ann["id"] is not None:
        return f"{base}/{ann['id']}"
    if ann["query"]:
        return f"{base}/{hashlib.sha256(ann['query'].encode()).hexdigest()[:8]}"
    return base


def write_windows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=WINDOW_SCHEMA)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def read_windows(path: Path, split: str | None = None) -> list[dict]:
    """The rows of ``windows.parquet`` in file order; only those of ``split`` when given."""
    rows = pq.ParquetFile(path).read().to_pylist()  # read_table would import pyarrow.dataset and pandas
    return rows if split is None else [row for row in rows if row["split"] == split]


def windows_by_video(windows: list[dict], root: Path) -> dict[tuple[str, str | None], list[dict]]:
    """(path of the video under ``root``, query) -> its windows, in order: one cut list each
    (QVHighlights asks several queries of one video)."""
    by_video: dict[tuple[str, str | None], list[dict]] = {}
    for window in windows:
        by_video.setdefault((str(resolve_video(root, window["video"])), window["query"]), []).append(window)
    return by_video


def assign_splits(keys: list[str], val_fraction: float, seed: int) -> dict[str, str]:
    """'val' for the ``round(val_fraction * n)`` keys with the smallest seeded hash, else 'train'.

    The keys are the split's units (the window stage passes source videos). At least one goes to
    each split when there are two or more and ``val_fraction > 0``.
    """
    ranked = sorted(set(keys), key=lambda key: _video_hash(key, seed))
    n_val = round(val_fraction * len(ranked))
    if val_fraction > 0 and len(ranked) >= 2:
        n_val = min(max(n_val, 1), len(ranked) - 1)
    return {key: "val" if rank < n_val else "train" for rank, key in enumerate(ranked)}


def _video_hash(video: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{video}".encode()).hexdigest()


def check_sources_whole(rows: list[dict], source_of: dict[str, str]) -> None:
    """Raise AssertionError naming them if a source video (``source_of``: video -> source) has rows in
    more than one split (a video in both is such a case too): its clips on both sides would score the
    model on near-duplicates of its training footage. Grouping makes this impossible, so a failure is
    a bug in the split; a plain ``assert`` would vanish under ``python -O``."""
    seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # source -> split -> videos
    for row in rows:
        seen[source_of[row["video"]]][row["split"]].add(row["video"])
    straddling = sorted((source, by_split) for source, by_split in seen.items() if len(by_split) > 1)
    if straddling:
        examples = "; ".join(f"{source!r} (" + ", ".join(f"{split}: {sorted(videos)[:3]}" for split, videos
                                                      in sorted(by_split.items())) + ")"
                             for source, by_split in straddling[:5])
        raise AssertionError(f"{len(straddling)} source videos have windows in more than one split, e.g. {examples}; "
                             "the train / val split must keep each source whole: this is a bug in the split, "
                             "please report it")


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


def video_shards(windows: list[dict], shards: int) -> dict[str, int]:
    """The shard each video's windows go to: all of one video in one shard (one decoder open).

    Videos, most windows first, each to the shard with the fewest windows so far, so that shards
    finish together; every shard process computes the same assignment from the same windows.
    """
    counts: dict[str, int] = defaultdict(int)
    for window in windows:
        counts[window["video"]] += 1
    load = [0] * shards
    assignment = {}
    for video in sorted(counts, key=lambda name: (-counts[name], name)):
        assignment[video] = load.index(min(load))
        load[assignment[video]] += counts[video]
    return assignment

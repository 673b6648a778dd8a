"""Stage 1, window: cut long videos into windows and move keep ranges into window time.

A keep range ``[s, e]`` in source seconds becomes ``[s - w0, e - w0]`` in a window that starts at
``w0``; a range that crosses a window edge is clipped to the window, and a fragment shorter than
``window.min_fragment`` after clipping is dropped and counted.

Train / val is split by *source video*, the recording a video was cut from: each source goes to
one split with all its videos and windows, from a hash of the seed and the source, so the split
does not depend on the order of the annotation file. The source is a line's ``source`` field when
given; else, with ``data.format: videosft``, the ``video`` path (every file its own recording) and,
with ``qvhighlights``, the YouTube id (``-4Mlqc7PbZY`` of the clip ``-4Mlqc7PbZY_210.0_360.0``;
the two numbers are taken off the end, as ids hold ``_`` and ``-``). Splitting clips of one
recording would put near-duplicate footage on both sides of the evaluation (QVHighlights' val file
has 1519 clips of 474 YouTube videos). ``window.val_fraction`` is thus a fraction of sources; the
run record gives the rule and sources, videos and windows per split, and the stage fails if any
source ends up in both.

    python -m videosft.stages.window --config config.yaml --out results/window
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..data.annotations import SOURCE_RULES, read_annotations
from ..data.rejects import Rejects
from ..data.windows import (assign_splits, check_sources_whole, limit_empty_windows, window_id, window_row,
                            write_windows)
from ..media.timeline import merge_ranges, realign, window_bounds
from ..provenance import exit_after, kept_path, run_record, stage_parser, write_json


def cut_windows(annotations: list[tuple[dict, float]], window_cfg: View, counts: Counter) -> list[dict]:
    """Each annotation's windows, with its keep ranges (merged first) realigned into each of them."""
    rows = []
    for ann, duration in annotations:
        keep, merges = merge_ranges(ann["keep"])
        counts["annotations"] += 1
        counts["keep_ranges"] += len(ann["keep"])
        counts["keep_merged"] += merges
        bounds = window_bounds(duration, window_cfg.length, window_cfg.stride, window_cfg.tail)
        for index, (start, end) in enumerate(bounds):
            aligned = realign(keep, start, end, window_cfg.min_fragment)
            counts["fragments_clipped"] += aligned.clipped
            counts["fragments_dropped"] += len(aligned.dropped)
            rows.append(window_row(window_id(ann, index), ann["video"], ann["query"], None, duration, index,
                                   (start, end), aligned.source, aligned.local))
    return rows


def split_by_source(rows: list[dict], source_of: dict[str, str], window_cfg: View, counts: Counter) -> list[dict]:
    """The rows with their source video's split (``source_of``: video -> source; every video of a
    source in one split), past the limit on windows with nothing to keep, checked that no source
    straddles the splits."""
    splits = assign_splits([source_of[row["video"]] for row in rows], window_cfg.val_fraction, window_cfg.seed)
    for row in rows:
        row["split"] = splits[source_of[row["video"]]]
    videos = {row["video"]: row["split"] for row in rows}  # before the limit: it may drop all of a video's windows
    counts["windows_made"] = len(rows)
    counts["windows_empty_made"] = sum(not row["keep_local"] for row in rows)
    rows = limit_empty_windows(rows, window_cfg.max_empty_fraction, window_cfg.seed)
    check_sources_whole(rows, source_of)
    counts["windows"] = len(rows)
    counts["windows_empty"] = sum(not row["keep_local"] for row in rows)
    counts["windows_empty_dropped"] = counts["windows_empty_made"] - counts["windows_empty"]
    for row in rows:
        counts[f"windows_{row['split']}"] += 1
    for name, units in (("sources", splits), ("videos", videos)):
        counts[name] = len(units)
        for split in ("train", "val"):
            counts[f"{name}_{split}"] = sum(value == split for value in units.values())
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "window")
    with run_record("window", args.out, cfg, args) as record:
        rejects = Rejects(args.out / "rejects.jsonl", kept_path(args, "rejects.jsonl"))
        counts: Counter = Counter()
        annotations = read_annotations(Path(cfg.data.annotations), Path(cfg.data.root), cfg.data, rejects)
        source_of = {ann["video"]: ann["source"] for ann, _ in annotations}
        rows = split_by_source(cut_windows(annotations, cfg.window, counts), source_of, cfg.window, counts)
        write_windows(rows, args.out / "windows.parquet")
        record["results"] = {"split_by": SOURCE_RULES[cfg.data.format], "counts": dict(counts),
                             "rejects": rejects.summary()}
        write_json(args.out / "summary.json", record["results"])
        print(f"window: {counts['windows']} windows from {counts['annotations']} annotations of {counts['videos']} "
              f"videos from {counts['sources']} sources ({counts['sources_train']} train, {counts['sources_val']} "
              f"val; source: {SOURCE_RULES[cfg.data.format]}); {counts['windows_train']} train windows, "
              f"{counts['windows_val']} val ({counts['windows_empty']} with nothing to keep, "
              f"{counts['windows_empty_dropped']} more of those dropped); {counts['keep_merged']} "
              f"keep ranges merged, {counts['fragments_clipped']} clipped at window edges, "
              f"{counts['fragments_dropped']} fragments shorter than window.min_fragment dropped; "
              f"{len(rejects)} lines rejected")
        rejects.check(cfg.data.max_reject_fraction, total=counts["annotations"] + len(rejects),
                      what="annotation lines")
    return 0


if __name__ == "__main__":
    exit_after(main)

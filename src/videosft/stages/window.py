"""Stage 1, window: cut long videos into windows and move keep ranges into window time.

A keep range ``[s, e]`` in source seconds becomes ``[s - w0, e - w0]`` in a window that starts at
``w0``; a range that crosses a window edge is clipped to the window, and a fragment shorter than
``window.min_fragment`` after clipping is dropped and counted. Videos are split into train / val
as wholes, from a hash of the seed and the video path, so the split does not depend on the order
of the annotation file.

    python -m videosft.stages.window --config config.yaml --out results/window
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..data.annotations import read_annotations
from ..data.rejects import Rejects
from ..data.windows import assign_splits, limit_empty_windows, window_id, window_row, write_windows
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


def split_by_video(rows: list[dict], window_cfg: View, counts: Counter) -> list[dict]:
    """The rows with their videos' split, past the limit on windows with nothing to keep."""
    splits = assign_splits([row["video"] for row in rows], window_cfg.val_fraction, window_cfg.seed)
    for row in rows:
        row["split"] = splits[row["video"]]
    counts["windows_made"] = len(rows)
    counts["windows_empty_made"] = sum(not row["keep_local"] for row in rows)
    rows = limit_empty_windows(rows, window_cfg.max_empty_fraction, window_cfg.seed)
    counts["windows"] = len(rows)
    counts["windows_empty"] = sum(not row["keep_local"] for row in rows)
    counts["windows_empty_dropped"] = counts["windows_empty_made"] - counts["windows_empty"]
    for row in rows:
        counts[f"windows_{row['split']}"] += 1
    counts["videos"] = len(splits)
    counts["videos_val"] = sum(split == "val" for split in splits.values())
    counts["videos_train"] = sum(split == "train" for split in splits.values())
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "window")
    with run_record("window", args.out, cfg, args) as record:
        rejects = Rejects(args.out / "rejects.jsonl", kept_path(args, "rejects.jsonl"))
        counts: Counter = Counter()
        annotations = read_annotations(Path(cfg.data.annotations), Path(cfg.data.root), cfg.data, rejects)
        rows = split_by_video(cut_windows(annotations, cfg.window, counts), cfg.window, counts)
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

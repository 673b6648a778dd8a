"""Stage 2, preprocess: decode each window, apply the token budget, build chat and labels.

Each window becomes a checked sample through :func:`videosft.encoding.samples.build_sample` (frames under
the budget, the chat in the published layout, the processor's tensors, labels on the answer).

The windows are split into shards by video (``--shard i --shards n``, one Snakemake job each, so
``--cores n`` decodes on n cores); each shard writes ``train-NNNNN.parquet`` / ``val-NNNNN.parquet``
files of bounded size holding everything the trainer needs (it never decodes video), and
``rejects.jsonl`` for windows that could not be used. ``--gather`` joins the shards into
``manifest.json``, the one file later stages read. The files' schema, their writer and the
manifest are the sample store's (:mod:`videosft.data.sample_store`), through which later stages read.

    python -m videosft.stages.preprocess --config config.yaml --windows results/window/windows.parquet \\
        --shard 0 --shards 1 --out results/preprocess/shards/0
    python -m videosft.stages.preprocess --config config.yaml --gather results/preprocess/shards/0 \\
        --out results/preprocess
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from .. import config as config_lib
from ..config import View
from ..data.rejects import Rejects
from ..data.sample_store import ShardWriter, gather_shards, shard_metadata, shard_summary
from ..data.windows import read_windows, video_shards
from ..encoding.layout import layout_name
from ..encoding.samples import build_sample, processor_geometry, tells_time_by_grid
from ..errors import InputError
from ..media.budget import resolve_budget
from ..media.timeline import resolve_video
from ..media.video import VideoFile
from ..progress import ProgressLine
from ..provenance import existing_path, exit_after, kept_path, run_record, stage_parser, write_json


def summarize(values: list[float]) -> dict:
    if not values:
        return {}
    array = np.asarray(values, dtype=float)
    return {"min": float(array.min()), "mean": float(array.mean()), "max": float(array.max())}


def run_shard(windows_path: Path, out_dir: Path, cfg: View, shard: int, shards: int, record: dict,
              kept_rejects: Path | None = None) -> None:
    """Preprocess the windows of the videos that hash to ``shard`` (of ``shards``)."""
    from transformers import AutoProcessor

    model_path = Path(cfg.model.path)
    processor = AutoProcessor.from_pretrained(model_path)
    geometry = processor_geometry(processor)
    budget = resolve_budget(cfg.video)
    out_dir.mkdir(parents=True, exist_ok=True)
    rejects = Rejects(out_dir / "rejects.jsonl", kept_rejects)
    metadata = shard_metadata(cfg, budget.as_dict(), geometry,
                              layout_name(cfg.prompt.video_layout, tells_time_by_grid(processor)))
    writer = ShardWriter(out_dir, metadata, int(cfg.preprocess.shard_mb * 2**20),
                         cfg.preprocess.pixel_compression)
    windows = read_windows(windows_path)
    assignment = video_shards(windows, shards)
    windows = [w for w in windows if assignment[w["video"]] == shard]
    by_video: dict[str, list[dict]] = defaultdict(list)
    for window in windows:
        by_video[window["video"]].append(window)
    facts: dict[str, list] = defaultdict(list)
    root = Path(cfg.data.root)
    shown = ProgressLine(f"preprocess shard {shard}/{shards}", len(windows), "windows")
    for video_name, video_windows in by_video.items():
        try:
            video = VideoFile(resolve_video(root, video_name))
        except Exception as error:
            for window in video_windows:
                rejects.add(window["window_id"], error, video=video_name)
            shown.advance(len(video_windows), note=f"{len(rejects)} rejected")
            continue
        for window in video_windows:
            try:
                sample = build_sample(window, video, processor, cfg, budget, geometry)
            except Exception as error:  # one bad window never loses the others
                rejects.add(window["window_id"], error, video=video_name)
                sample = None
            shown.advance(note=f"{len(rejects)} rejected")
            if sample is None:
                continue
            writer.add(sample)
            for key in FACTS:
                facts[key].append(sample[key])
            facts["frames"].append(len(sample["frame_indices"]))
    files = writer.close()
    record["results"] = shard_summary(len(windows), writer, files, dict(facts), metadata, shard=shard, shards=shards,
                                      rejects=rejects.summary())
    write_json(out_dir / "summary.json", record["results"])
    print(f"preprocess shard {shard}/{shards}: {sum(writer.counts.values())} samples {dict(writer.counts)} from "
          f"{len(windows)} windows, {len(rejects)} rejected")


FACTS = ("visual_tokens", "text_tokens", "input_tokens", "supervised_tokens", "decode_seconds", "budget_max_tokens")


def gather(shard_dirs: list[Path], out_dir: Path, cfg: View, record: dict, kept_rejects: Path | None = None) -> None:
    """Join the shards: one manifest of sample files per split, the rejects, the summary, the checks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = gather_shards(shard_dirs, out_dir)
    rejects = Rejects.merged(out_dir / "rejects.jsonl", [directory / "rejects.jsonl" for directory in shard_dirs],
                             kept_rejects)
    windows, counts, budget = shards.windows, shards.samples, shards.budget
    record["results"] = {
        "windows": windows, "samples": counts, "rejects": len(rejects),
        "rejects_by_reason": rejects.summary()["by_reason"],
        "budget": budget, "geometry": shards.geometry, "shards": len(shard_dirs),
        "video_layout": shards.video_layout, "think_block": shards.think_block,
        **{key: summarize(values) for key, values in shards.facts.items()},
    }
    results = record["results"]
    print(
        f"preprocess: {sum(counts.values())} samples ({dict(counts)}) from {windows} windows in {len(shard_dirs)} "
        f"shards, {len(rejects)} rejected; frames {results.get('frames')}, visual tokens "
        f"{results.get('visual_tokens')}, input tokens {results.get('input_tokens')}, supervised "
        f"{results.get('supervised_tokens')}; budget {budget['min_tokens']}-{budget['max_tokens']} tokens per frame "
        f"pair ({budget['max_tokens_from']})"
    )
    rejects.check(cfg.data.max_reject_fraction, total=windows, what="windows")
    for split in ("train", "val"):
        if not counts.get(split):
            raise InputError(f"no {split} samples were produced; check the window split and the rejects")
    shards.write_manifest(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--windows", type=existing_path, help="windows.parquet from the window stage (shard mode)")
    parser.add_argument("--shard", type=int, default=0, help="which shard to preprocess (0-based)")
    parser.add_argument("--shards", type=int, default=1, help="how many shards the windows are split into")
    parser.add_argument("--gather", type=existing_path, nargs="+", help="shard directories to join into a manifest")
    args = parser.parse_args(argv)
    if (args.windows is None) == (args.gather is None):
        parser.error("give either --windows (preprocess a shard) or --gather (join shards)")
    if not 0 <= args.shard < args.shards:
        parser.error(f"--shard {args.shard} is not in 0..{args.shards - 1}")
    cfg = config_lib.load(args.config, "preprocess")
    with run_record("preprocess", args.out, cfg, args) as record:
        if args.gather:
            gather(args.gather, args.out, cfg, record, kept_path(args, "rejects.jsonl"))
        else:
            run_shard(args.windows, args.out, cfg, args.shard, args.shards, record, kept_path(args, "rejects.jsonl"))
    return 0


if __name__ == "__main__":
    exit_after(main)

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

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from .. import config as config_lib
from ..encoding.budget import resolve_budget
from ..encoding.samples import build_sample, processor_geometry, tells_time_by_grid
from ..errors import InputError
from ..encoding.layout import layout_name
from ..progress import ProgressLine
from ..provenance import exit_after, run_record, sha256_file, stage_parser, write_json
from ..config import View
from ..data.rejects import Rejects
from ..data.sample_store import SCHEMA_VERSION, ShardWriter, write_manifest
from ..media.timeline import resolve_video
from ..media.video import VideoFile


def model_hashes(model_path: Path) -> dict:
    names = ["tokenizer.json", "tokenizer_config.json", "processor_config.json",
             "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"]
    return {name: sha256_file(model_path / name) for name in names if (model_path / name).exists()}


def summarize(values: list[float]) -> dict:
    if not values:
        return {}
    array = np.asarray(values, dtype=float)
    return {"min": float(array.min()), "mean": float(array.mean()), "max": float(array.max())}


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


def shard_metadata(cfg: View, processor, budget, geometry: dict) -> dict:
    """What every sample file of a shard records about how its samples were made."""
    return {
        "schema_version": SCHEMA_VERSION,
        "budget": budget.as_dict(),
        "geometry": geometry,
        "model_files_sha256": model_hashes(Path(cfg.model.path)),
        "max_length": cfg.data.max_length,
        "video_layout": layout_name(cfg.prompt.video_layout, tells_time_by_grid(processor)),
        "think_block": cfg.prompt.think_block,
    }


def shard_summary(windows: int, writer, files: dict, facts: dict, metadata: dict, **extra) -> dict:
    """What a shard tells the gather step (written as summary.json)."""
    return {"windows": windows, "samples": dict(writer.counts), "files": files, "facts": facts,
            "budget": metadata["budget"], "geometry": metadata["geometry"],
            "video_layout": metadata["video_layout"], "think_block": metadata["think_block"], **extra}


def run_shard(windows_path: Path, out_dir: Path, cfg: View, shard: int, shards: int, record: dict) -> None:
    """Preprocess the windows of the videos that hash to ``shard`` (of ``shards``)."""
    from transformers import AutoProcessor

    model_path = Path(cfg.model.path)
    processor = AutoProcessor.from_pretrained(model_path)
    geometry = processor_geometry(processor)
    budget = resolve_budget(cfg.video)
    out_dir.mkdir(parents=True, exist_ok=True)
    rejects = Rejects(out_dir / "rejects.jsonl")
    metadata = shard_metadata(cfg, processor, budget, geometry)
    writer = ShardWriter(out_dir, metadata, int(cfg.preprocess.shard_mb * 2**20),
                         cfg.preprocess.pixel_compression)
    windows = pq.ParquetFile(windows_path).read().to_pylist()  # read_table would import pyarrow.dataset and pandas
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


def gather(shard_dirs: list[Path], out_dir: Path, cfg: View, record: dict) -> None:
    """Join the shards: one manifest of sample files per split, the rejects, the summary, the checks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [json.loads((directory / "summary.json").read_text()) for directory in shard_dirs]
    files: dict[str, list[str]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    facts: dict[str, list] = defaultdict(list)
    for directory, summary in zip(shard_dirs, summaries):
        for split, names in summary["files"].items():
            files[split] += [str((directory / name).resolve().relative_to(out_dir.resolve())) for name in names]
        for split, count in summary["samples"].items():
            counts[split] += count
        for key, values in summary["facts"].items():
            facts[key] += values
    rejects = Rejects.merged(out_dir / "rejects.jsonl", [directory / "rejects.jsonl" for directory in shard_dirs])
    windows = sum(summary["windows"] for summary in summaries)
    budget = summaries[0]["budget"]
    record["results"] = {
        "windows": windows, "samples": dict(counts), "rejects": len(rejects),
        "rejects_by_reason": rejects.summary()["by_reason"],
        "budget": budget, "geometry": summaries[0]["geometry"], "shards": len(shard_dirs),
        "video_layout": summaries[0]["video_layout"], "think_block": summaries[0]["think_block"],
        **{key: summarize(values) for key, values in facts.items()},
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
    write_manifest(out_dir, dict(files), dict(counts), budget, summaries[0]["geometry"], summaries[0]["video_layout"],
                   summaries[0]["think_block"])


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--windows", type=Path, help="windows.parquet from the window stage (shard mode)")
    parser.add_argument("--shard", type=int, default=0, help="which shard to preprocess (0-based)")
    parser.add_argument("--shards", type=int, default=1, help="how many shards the windows are split into")
    parser.add_argument("--gather", type=Path, nargs="+", help="shard directories to join into a manifest")
    args = parser.parse_args(argv)
    if (args.windows is None) == (args.gather is None):
        parser.error("give either --windows (preprocess a shard) or --gather (join shards)")
    if not 0 <= args.shard < args.shards:
        parser.error(f"--shard {args.shard} is not in 0..{args.shards - 1}")
    cfg = config_lib.load(args.config, "preprocess")
    with run_record("preprocess", args.out, cfg, args) as record:
        if args.gather:
            gather(args.gather, args.out, cfg, record)
        else:
            run_shard(args.windows, args.out, cfg, args.shard, args.shards, record)
    return 0


if __name__ == "__main__":
    exit_after(main)

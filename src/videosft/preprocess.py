"""Stage 2, preprocess: decode each window, apply the token budget, build chat and labels.

Each window becomes a checked sample through :func:`videosft.encoding.build_sample` (frames under
the budget, the chat in the published layout, the processor's tensors, labels on the answer).

The windows are split into shards by video (``--shard i --shards n``, one Snakemake job each, so
``--cores n`` decodes on n cores); each shard writes ``train-NNNNN.parquet`` / ``val-NNNNN.parquet``
files of bounded size holding everything the trainer needs (it never decodes video), and
``rejects.jsonl`` for windows that could not be used. ``--gather`` joins the shards into
``manifest.json``, the one file later stages read.

    python -m videosft.preprocess --config config.yaml --windows results/window/windows.parquet \\
        --shard 0 --shards 1 --out results/preprocess/shards/0
    python -m videosft.preprocess --config config.yaml --gather results/preprocess/shards/0 \\
        --out results/preprocess
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import config as config_lib
from .budget import resolve_budget
from .encoding import build_sample, processor_geometry, tells_time_by_grid
from .errors import InputError
from .layout import layout_name
from .provenance import exit_after, run_record, sha256_file, stage_parser, write_json
from .rejects import Rejects
from .timeline import resolve_video
from .video import VideoFile

SCHEMA_VERSION = 3  # 2: second_per_grid (Qwen2.5-VL's time step per frame pair); 3: video_layout
ROW_GROUP = 8

SAMPLE_SCHEMA = pa.schema(
    [
        ("window_id", pa.string()),
        ("split", pa.string()),
        ("video", pa.string()),
        ("query", pa.string()),
        ("window_start", pa.float64()),
        ("window_end", pa.float64()),
        ("keep_local", pa.list_(pa.list_(pa.float64(), 2))),
        ("answer", pa.string()),
        ("frame_indices", pa.list_(pa.int32())),
        ("frame_times", pa.list_(pa.float64())),
        ("video_grid_thw", pa.list_(pa.int32(), 3)),
        ("source_size", pa.list_(pa.int32(), 2)),
        ("frame_size", pa.list_(pa.int32(), 2)),
        ("visual_tokens", pa.int32()),
        ("text_tokens", pa.int32()),
        ("input_tokens", pa.int32()),
        ("supervised_tokens", pa.int32()),
        ("decode_seconds", pa.float64()),
        ("budget_max_tokens", pa.int32()),  # per frame pair; below video.max_tokens when fitted
        ("second_per_grid", pa.float64()),  # Qwen2.5-VL's seconds per frame pair; null where markers tell time
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("mm_token_type_ids", pa.list_(pa.int8())),
        ("pixel_values", pa.binary()),  # float16, row-major, shape pixel_shape
        ("pixel_shape", pa.list_(pa.int32(), 2)),
    ]
)


def model_hashes(model_path: Path) -> dict:
    names = ["tokenizer.json", "tokenizer_config.json", "processor_config.json",
             "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"]
    return {name: sha256_file(model_path / name) for name in names if (model_path / name).exists()}


# The pixel column is most of every file: dictionary encoding and min/max statistics of
# megabyte-sized unique blobs cost time and buy nothing; its compression is a config choice
# (preprocess.pixel_compression), the small columns always use snappy.
_SMALL_COLUMNS = [name for name in SAMPLE_SCHEMA.names if name != "pixel_values"]


def parquet_options(pixel_compression: str) -> dict:
    return {"use_dictionary": _SMALL_COLUMNS, "write_statistics": _SMALL_COLUMNS,
            "compression": {**dict.fromkeys(_SMALL_COLUMNS, "snappy"), "pixel_values": pixel_compression}}


class ShardWriter:
    """Streams samples into ``<split>-NNNNN.parquet`` files of bounded size, in small row groups.

    Memory holds at most one row group; a file is closed and the next begun once it passes
    ``max_bytes``, so neither memory nor file size grows with the number of windows.
    """

    def __init__(self, out_dir: Path, metadata: dict, max_bytes: int, pixel_compression: str = "none"):
        self.out_dir = out_dir
        self.options = parquet_options(pixel_compression)
        self.schema = SAMPLE_SCHEMA.with_metadata({"videosft": json.dumps(metadata)})
        self.max_bytes = max_bytes
        self.open: dict[str, tuple[pq.ParquetWriter, Path, Path]] = {}
        self.bytes: dict[str, int] = defaultdict(int)
        self.pending: dict[str, list[dict]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.files: dict[str, list[str]] = defaultdict(list)

    def add(self, sample: dict) -> None:
        split = sample["split"]
        self.pending[split].append(sample)
        self.counts[split] += 1
        self.bytes[split] += len(sample["pixel_values"]) + 8 * len(sample["input_ids"])
        if len(self.pending[split]) >= ROW_GROUP:
            self._flush(split)
        if self.bytes[split] >= self.max_bytes:
            self._close(split)

    def _flush(self, split: str) -> None:
        if not self.pending[split]:
            return
        if split not in self.open:
            final = self.out_dir / f"{split}-{len(self.files[split]):05d}.parquet"
            tmp = final.with_name(f".{final.name}.tmp")
            self.open[split] = (pq.ParquetWriter(tmp, self.schema, **self.options), tmp, final)
        self.open[split][0].write_table(pa.Table.from_pylist(self.pending[split], schema=self.schema))
        self.pending[split] = []

    def _close(self, split: str) -> None:
        self._flush(split)
        if split in self.open:
            writer, tmp, final = self.open.pop(split)
            writer.close()
            tmp.replace(final)  # a file that exists is complete
            self.files[split].append(final.name)
        self.bytes[split] = 0

    def close(self) -> dict[str, list[str]]:
        for split in list(self.pending) + list(self.open):
            self._close(split)
        return dict(self.files)


def read_metadata(path: Path) -> dict:
    """The videosft metadata of a samples file; refuses a schema version this code does not know."""
    raw = pq.read_schema(path).metadata or {}
    if b"videosft" not in raw:
        raise InputError(f"{path} has no videosft metadata: it was not written by the preprocess stage")
    metadata = json.loads(raw[b"videosft"])
    if metadata.get("schema_version") != SCHEMA_VERSION:
        raise InputError(
            f"{path} has sample schema version {metadata.get('schema_version')}, this code reads "
            f"version {SCHEMA_VERSION}; rerun the preprocess stage"
        )
    return metadata


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


def shard_metadata(cfg: dict, processor, budget, geometry: dict) -> dict:
    """What every sample file of a shard records about how its samples were made."""
    return {
        "schema_version": SCHEMA_VERSION,
        "budget": budget.as_dict(),
        "geometry": geometry,
        "model_files_sha256": model_hashes(Path(cfg["model"]["path"])),
        "max_length": cfg["data"]["max_length"],
        "video_layout": layout_name(cfg["prompt"]["video_layout"], tells_time_by_grid(processor)),
        "think_block": cfg["prompt"]["think_block"],
    }


def shard_summary(windows: int, writer, files: dict, facts: dict, metadata: dict, **extra) -> dict:
    """What a shard tells the gather step (written as summary.json)."""
    return {"windows": windows, "samples": dict(writer.counts), "files": files, "facts": facts,
            "budget": metadata["budget"], "geometry": metadata["geometry"],
            "video_layout": metadata["video_layout"], "think_block": metadata["think_block"], **extra}


def run_shard(windows_path: Path, out_dir: Path, cfg: dict, shard: int, shards: int, record: dict) -> None:
    """Preprocess the windows of the videos that hash to ``shard`` (of ``shards``)."""
    from transformers import AutoProcessor

    model_path = Path(cfg["model"]["path"])
    processor = AutoProcessor.from_pretrained(model_path)
    geometry = processor_geometry(processor)
    budget = resolve_budget(cfg["video"])
    out_dir.mkdir(parents=True, exist_ok=True)
    rejects = Rejects(out_dir / "rejects.jsonl")
    metadata = shard_metadata(cfg, processor, budget, geometry)
    writer = ShardWriter(out_dir, metadata, int(cfg["preprocess"]["shard_mb"] * 2**20),
                         cfg["preprocess"]["pixel_compression"])
    windows = pq.ParquetFile(windows_path).read().to_pylist()  # read_table would import pyarrow.dataset and pandas
    assignment = video_shards(windows, shards)
    windows = [w for w in windows if assignment[w["video"]] == shard]
    by_video: dict[str, list[dict]] = defaultdict(list)
    for window in windows:
        by_video[window["video"]].append(window)
    facts: dict[str, list] = defaultdict(list)
    root = Path(cfg["data"]["root"])
    for video_name, video_windows in by_video.items():
        try:
            video = VideoFile(resolve_video(root, video_name))
        except Exception as error:
            for window in video_windows:
                rejects.add(window["window_id"], error, video=video_name)
            continue
        for window in video_windows:
            try:
                sample = build_sample(window, video, processor, cfg, budget, geometry)
            except Exception as error:  # one bad window never loses the others
                rejects.add(window["window_id"], error, video=video_name)
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
MANIFEST = "manifest.json"


def gather(shard_dirs: list[Path], out_dir: Path, cfg: dict, record: dict) -> None:
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
    rejects.check(cfg["data"]["max_reject_fraction"], total=windows, what="windows")
    for split in ("train", "val"):
        if not counts.get(split):
            raise InputError(f"no {split} samples were produced; check the window split and the rejects")
    write_json(out_dir / MANIFEST, {"schema_version": SCHEMA_VERSION, "files": dict(files), "samples": dict(counts),
                                    "budget": budget, "geometry": summaries[0]["geometry"],
                                    "video_layout": summaries[0]["video_layout"],
                                    "think_block": summaries[0]["think_block"]})


def sample_files(manifest_path: Path, split: str) -> list[Path]:
    """The sample files of one split, as the manifest lists them; each file's version is checked."""
    manifest = json.loads(Path(manifest_path).read_text())
    paths = [Path(manifest_path).parent / name for name in manifest["files"].get(split, [])]
    for path in paths:
        read_metadata(path)
    return paths


def read_samples(manifest_path: Path, split: str, columns: list[str] | None = None) -> list[dict]:
    return [row for path in sample_files(manifest_path, split)
            for row in pq.read_table(path, columns=columns).to_pylist()]


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

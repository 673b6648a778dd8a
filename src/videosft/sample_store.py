"""The sample store: the Parquet files the preprocess stage writes and every later stage reads.

This module is the contract between the one writer (preprocess) and the readers (probe, train,
verify, report; tests and benchmarks), so that none of them imports the preprocess stage:

* a sample is one row of :data:`SAMPLE_SCHEMA` (tokens, labels, the frames the processor was given
  as lossless images, and the facts about how it was made); :mod:`videosft.pixels` turns the frames into
  the model's ``pixel_values_videos``; :class:`ShardWriter` streams rows into
  ``<split>-NNNNN.parquet`` files of bounded size, in row groups of :data:`ROW_GROUP` rows;
* every file carries, under the schema metadata key ``videosft``, what its samples were made with
  (the preprocess stage fills it: budget, geometry, model file hashes, ...), including
  ``schema_version``; :func:`read_metadata` refuses a version other than :data:`SCHEMA_VERSION`,
  so a reader never misreads samples written by other code;
* ``manifest.json`` (:func:`write_manifest`) lists each split's files relative to itself, with the
  sample counts, the budget, geometry, video layout and think block; :func:`sample_files` and
  :func:`read_samples` read through it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError
from .pixels import stored_bytes
from .provenance import write_json

SCHEMA_VERSION = 4  # 2: second_per_grid (Qwen2.5-VL's time step per frame pair); 3: video_layout;
#                     4: the processor's input frames instead of its float16 pixels
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
        ("frames", pa.list_(pa.binary())),  # one lossless WebP per frame (videosft.pixels)
        ("frames_shape", pa.list_(pa.int32(), 4)),  # (T, 3, H, W) uint8, as the processor got them
    ]
)


# The frames column is most of every file: dictionary encoding and min/max statistics of
# megabyte-sized unique blobs cost time and buy nothing; its compression is a config choice
# (preprocess.pixel_compression), the small columns always use snappy. Parquet names a list's
# values by their leaf path, so that is what the codec is given for.
_SMALL_COLUMNS = [name for name in SAMPLE_SCHEMA.names if name != "frames"]
FRAMES_LEAF = "frames.list.element"


def parquet_options(pixel_compression: str) -> dict:
    return {"use_dictionary": _SMALL_COLUMNS, "write_statistics": _SMALL_COLUMNS,
            "compression": {**dict.fromkeys(_SMALL_COLUMNS, "snappy"), FRAMES_LEAF: pixel_compression}}


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
        self.bytes[split] += stored_bytes(sample) + 8 * len(sample["input_ids"])
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


MANIFEST = "manifest.json"


def write_manifest(out_dir: Path, files: dict[str, list[str]], samples: dict[str, int], budget: dict,
                   geometry: dict, video_layout: str, think_block: str) -> None:
    """``manifest.json``: each split's sample files (relative to ``out_dir``) and counts, and how the
    samples were made."""
    write_json(out_dir / MANIFEST, {"schema_version": SCHEMA_VERSION, "files": files, "samples": samples,
                                    "budget": budget, "geometry": geometry, "video_layout": video_layout,
                                    "think_block": think_block})


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

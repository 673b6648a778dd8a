"""What decoding the next batch's frames costs the thread that launches the step, on the host alone.

    python bench/frame_decoding.py [--frames 128 --size 448 --processes 1 4 --seconds 3]

On a GPU the train step is launched from Python, so the main thread's pace is the step's pace
wherever the device waits on it. This measures that pace as the rate of a loop of small torch
calls (a stand-in for kernel launches and ZeRO-3's hooks) alone, beside a thread that decodes one
stored sample after another in-process (``EncodedFrames.decode``, what the batch thread did), and
beside the same thread waiting on worker processes (``FrameWorkers``, what it does on a GPU); and
the latency of one sample's decode each way. Frames are lossless WebP as the sample store keeps
them, of a smooth synthetic picture with noise (real video compresses between the two).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def sample(frames: int, size: int):
    import numpy as np
    import torch
    from PIL import Image

    from videosft.media.pixels import EncodedFrames, stored_frames

    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    pictures = []
    for t in range(frames):
        picture = np.asarray(Image.fromarray(np.roll(base, t, 0)).resize((size, size), Image.BILINEAR)).copy()
        picture[:, :, 0] ^= rng.integers(0, 8, (size, size), dtype=np.uint8)
        pictures.append(picture)
    stored = stored_frames(torch.from_numpy(np.stack(pictures)).permute(0, 3, 1, 2).contiguous())
    return EncodedFrames(tuple(stored["frames"]), tuple(stored["frames_shape"]), "bench")


def loop_rate(seconds: float, beside=None) -> float:
    """Small torch calls per second on this thread, while ``beside`` runs over and over on another."""
    import torch

    stop = threading.Event()

    def again():
        while not stop.is_set():
            beside()

    other = threading.Thread(target=again) if beside else None
    if other:
        other.start()
        time.sleep(0.5)  # the other thread is in its stride
    x, turns, start = torch.zeros(16), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            x.add_(1)
        turns += 1000
    rate = turns / (time.perf_counter() - start)
    stop.set()
    if other:
        other.join()
    return rate


def latency(decode, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    from videosft.media.frame_workers import FrameWorkers

    encoded = sample(args.frames, args.size)
    alone = loop_rate(args.seconds)
    rows = [{"decoding": "none", "loop_rate": alone, "relative": 1.0, "decode_s": None},
            {"decoding": "in a thread", "loop_rate": loop_rate(args.seconds, encoded.decode),
             "decode_s": latency(encoded.decode)}]
    for processes in args.processes:
        workers = FrameWorkers(processes)
        workers.decode(encoded)  # started and warm
        rows.append({"decoding": f"{processes} worker process(es)",
                     "loop_rate": loop_rate(args.seconds, lambda: workers.decode(encoded)),
                     "decode_s": latency(lambda: workers.decode(encoded))})
        workers.close()
    for row in rows:
        row["relative"] = row["loop_rate"] / alone
    print(json.dumps({"frames": args.frames, "size": args.size, "cores": len(os.sched_getaffinity(0)),
                      "stored_mb": round(sum(map(len, encoded.images)) / 1e6, 1), "rows": rows}))
    print(f"\n{args.frames} frames of {args.size}x{args.size}, {len(os.sched_getaffinity(0))} cores")
    print("| beside the loop | loop rate (calls/s) | relative to alone | one sample's decode (s) |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        decode = "-" if row["decode_s"] is None else f"{row['decode_s']:.2f}"
        print(f"| {row['decoding']} | {row['loop_rate']:,.0f} | {row['relative']:.2f} | {decode} |")


if __name__ == "__main__":
    main()

"""Where the device waited: the compute stream's idle gaps in a profiled step's timeline.

    python bench/trace_summary.py bench/runs/<trace>.json.gz [--top 15]

Reads the Chrome trace the train stage writes beside its profile table (`train.profile_step`) and
prints: the step's span, each stream's busy time (union of its kernels and copies), how much of
the collective stream's time hides under compute, the compute stream's idle gaps, and the compute
stream's kernel time by kind of work (matrix products on tensor cores or in fp32, attention, the
Gated-DeltaNet, fused norms and activations, elementwise work and copies). A gap is charged to the
host operators running on the launching thread at its midpoint (innermost first, then their
callers): the host work the device was waiting for.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# Kinds of device work by kernel name, the first match wins. The fp32 products run on CUDA cores (the
# ffma tiles), a tensor-core product's cost many times over per FLOP.
KERNEL_KINDS = (
    ("matrix products, fp32", ("gemm_f32", "simt_sgemm", "sgemm_")),
    ("matrix products", ("nvjet", "gemm", "cutlass", "splitkreduce", "xmma")),
    ("attention", ("sdpa", "flash", "fmha", "cudnn::fusion")),
    ("Gated-DeltaNet and its convolution", ("chunk_", "wy_repr", "recompute_w_u", "causal_conv1d", "l2norm")),
    ("fused norms and activations", ("layer_norm", "rms_norm", "swiglu")),
    ("vision rotary embedding, fused", ("rotary_kernel",)),  # videosft.kernels.vision_rotary
    ("elementwise, reductions and copies", ("elementwise", "cat", "copy", "reduce", "memset", "memcpy", "fill",
                                           "scatter", "gather", "scan", "softmax", "multi_tensor")),
)


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(mark in name for mark in marks)), "other")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def covered(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Overlap of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def gaps(busy: list[tuple[float, float]], minimum_us: float) -> list[tuple[float, float]]:
    return [(end, start) for (_, end), (start, _) in zip(busy, busy[1:]) if start - end >= minimum_us]


class HostStacks:
    """Operators on one host thread, to ask which were running at an instant."""

    def __init__(self, ops: list[dict]):
        self.ops = sorted(ops, key=lambda op: op["ts"])
        self.starts = [op["ts"] for op in self.ops]

    def running_at(self, instant: float) -> list[str]:
        """Names of the operators spanning the instant, innermost first."""
        stack = [op for op in self.ops[:bisect.bisect_right(self.starts, instant)]
                 if op["ts"] + op.get("dur", 0) >= instant]
        return [op["name"] for op in sorted(stack, key=lambda op: op.get("dur", 0))]


def summarize(events: list[dict], minimum_gap_us: float = 20.0, top: int = 15) -> dict:
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"]
    if not device:
        raise ValueError("the trace holds no device kernels or copies: it was taken on CPU")
    per_stream = collections.defaultdict(list)
    for event in device:
        per_stream[event["args"].get("stream")].append((event["ts"], event["ts"] + event["dur"]))
    busy = {stream: union(spans) for stream, spans in per_stream.items()}
    collective_time = collections.Counter()
    for event in device:
        if event["name"].startswith("nccl"):
            collective_time[event["args"].get("stream")] += event["dur"]
    # a stream is a collectives stream when most of its time is NCCL (a reduction may run on compute)
    collective_streams = {stream for stream, spent in collective_time.items()
                          if spent > covered(busy[stream]) / 2}
    compute_stream = max((s for s in busy if s not in collective_streams), key=lambda s: covered(busy[s]))
    compute = busy[compute_stream]
    span = (min(s for s, _ in compute), max(e for _, e in compute))

    # A gap ends when the next kernel starts; its launch names the host thread the device waited on
    # (the forward launches from the main thread, the backward from autograd's device thread).
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in {"cuda_runtime", "cuda_driver"} and "correlation" in e.get("args", {})}
    compute_events = sorted((e for e in device if e["args"].get("stream") == compute_stream), key=lambda e: e["ts"])
    compute_starts = [e["ts"] for e in compute_events]
    host_ops = collections.defaultdict(list)
    for event in events:
        if event.get("cat") in {"cpu_op", "user_annotation"} and event.get("ph") == "X":
            host_ops[event["tid"]].append(event)
    stacks = {tid: HostStacks(ops) for tid, ops in host_ops.items()}
    thread_names = {e["tid"]: e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name" and "tid" in e}

    idle = gaps(compute, minimum_gap_us)
    charged_inner, charged_outer, charged_thread = collections.Counter(), collections.Counter(), collections.Counter()
    for start, end in idle:
        following = compute_events[bisect.bisect_left(compute_starts, end)]
        launch = launches.get(following["args"].get("correlation"))
        tid = launch["tid"] if launch else None
        stack = stacks[tid].running_at((start + end) / 2) if tid in stacks else []
        charged_thread[str(thread_names.get(tid, tid))] += end - start
        charged_inner[stack[0] if stack else "(no host operator)"] += end - start
        charged_outer[" < ".join(stack[:3]) if stack else "(no host operator)"] += end - start

    by_kind, top_kernels = collections.Counter(), collections.Counter()
    for event in compute_events:
        by_kind[kind_of(event["name"])] += event["dur"]
        top_kernels[event["name"][:80]] += event["dur"]

    wall = span[1] - span[0]
    streams = {}
    for stream, spans in busy.items():
        streams[str(stream)] = {"busy_ms": covered(spans) / 1e3,
                                "role": "compute" if stream == compute_stream else
                                ("collectives" if stream in collective_streams else "other")}
    for stream in collective_streams:
        streams[str(stream)]["hidden_under_compute_ms"] = intersection(busy[stream], compute) / 1e3
    return {
        "span_ms": wall / 1e3,
        "streams": streams,
        "compute_idle_ms": (wall - covered(compute)) / 1e3,
        "idle_gaps": {"count": len(idle), "ms": sum(e - s for s, e in idle) / 1e3,
                      "minimum_us": minimum_gap_us},
        "idle_by_launching_thread_ms": {name: ms / 1e3 for name, ms in charged_thread.most_common()},
        "idle_by_host_operator_ms": {name: ms / 1e3 for name, ms in charged_inner.most_common(top)},
        "idle_by_host_stack_ms": {name: ms / 1e3 for name, ms in charged_outer.most_common(top)},
        "compute_ms_by_kind": {kind: ms / 1e3 for kind, ms in by_kind.most_common()},
        "compute_ms_by_kernel": {name: ms / 1e3 for name, ms in top_kernels.most_common(top)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(json.dumps(summarize(load_events(args.trace), args.min_gap_us, args.top), indent=1))


if __name__ == "__main__":
    main()

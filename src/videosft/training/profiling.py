"""Where a training step's time and memory go: peak memory per step (and a whole process's GPU peak),
and one step profiled on request (``train.profile_step``): torch.profiler's operators and timeline,
then the next step's Python functions under cProfile."""

from __future__ import annotations

import contextlib
import cProfile
import gzip
import io
import pstats
import resource
import shutil
import time
from pathlib import Path


def reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def gpu_peak_gib() -> dict | None:
    """The most GPU memory this process held (allocated and reserved), or None on the CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {"allocated": torch.cuda.max_memory_allocated() / 2**30, "reserved": torch.cuda.max_memory_reserved() / 2**30}


def start_profiler(device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def write_profile(profiler, device, path: Path, step: int, seconds: float) -> None:
    """The profiled step's operators, most self time on the device first (on CPU: on the host), and
    its timeline."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.stop()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70)
    path.write_text(f"step {step}: {seconds:.3f} s wall (profiled), operators by {key}\n{table}\n")
    # The table sums time; only the timeline shows where the device waited on the host.
    trace = path.with_suffix(".trace.json")
    profiler.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def write_python_profile(python, path: Path, step: int) -> None:
    """The main thread's Python functions in one step: when the device waits on the host, which
    code kept it waiting. Taken the step after the operator profile: cProfile slows Python-heavy
    code, which would distort that step's timeline."""
    python.disable()
    functions = io.StringIO()
    stats = pstats.Stats(python, stream=functions)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(50)  # the nested module wrappers take many rows each
    path.write_text(f"step {step}: the main thread's Python functions (cProfile; compare shares, not times)\n"
                    f"{functions.getvalue()}")


class Timed:
    """A step's wall time, known once the step has ended."""
    seconds: float = 0.0


class StepProfiles:
    """``train.profile_step`` N: step N under torch.profiler, step N + 1 under cProfile, each written to
    ``out/profile.rank<r>.*``; every other step runs as it would without."""

    def __init__(self, profile_step: int | None, device, out: Path, rank: int):
        self.profile_step, self.device = profile_step, device
        self.operators = Path(out) / f"profile.rank{rank}.txt"
        self.python = Path(out) / f"profile.rank{rank}.python.txt"

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one step: yields its :class:`Timed`, whose seconds are set when the step ends (before
        the profiles are written, which are not the step's time)."""
        profiler = start_profiler(self.device) if step == self.profile_step else None
        python = cProfile.Profile() if self.profile_step is not None and step == self.profile_step + 1 else None
        if python:
            python.enable()
        timed, started = Timed(), time.perf_counter()
        yield timed
        timed.seconds = time.perf_counter() - started
        if profiler:
            write_profile(profiler, self.device, self.operators, step, timed.seconds)
        if python:
            write_python_profile(python, self.python, step)

"""Helpers of the benchmarks in bench/: timing with a record of other load, bounded runs, results file, tables."""

from __future__ import annotations

import datetime as dt
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=PROJECT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench")
    return commit + (" (tracked files outside bench/ modified)" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs, Linux {platform.release()}, Python {platform.python_version()}"


def command_line() -> str:
    """The command that produced the results, as typed from the project root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(PROJECT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def update_section(results: Path, name: str, body: str) -> None:
    """Replace (or append) the section between this script's markers in the results file."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = results.read_text() if results.exists() else "# Benchmark results\n\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    results.write_text(text)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    return f"{median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def one_cpu() -> int:
    return min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all CPUs, from /proc/stat)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its waited-for descendants."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def other_load(seconds: float = 1.0) -> float:
    """CPUs' worth of work that other processes on the machine are doing now."""
    busy, own, started = busy_seconds(), own_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - started
    return max(0.0, (busy_seconds() - busy) - (own_cpu_seconds() - own)) / wall


QUIET = 0.2  # CPUs of other load below which a measurement counts as taken on a quiet machine


def quiet(runs: list[dict]) -> list[dict]:
    """The runs taken while other processes used less than QUIET CPUs, or all runs if none was."""
    calm = [run for run in runs if run["other"] < QUIET]
    return calm or runs


def used(runs: list[dict]) -> str:
    calm = sum(run["other"] < QUIET for run in runs)
    return f"{calm}/{len(runs)}" if calm else f"0/{len(runs)}: all used"


WAIT_IDLE = {"seconds": 0.0, "threshold": 0.25}


def wait_for_quiet() -> None:
    """Wait (up to --wait-idle seconds) until other processes use less than a quarter of a CPU."""
    deadline = time.perf_counter() + WAIT_IDLE["seconds"]
    while time.perf_counter() < deadline and other_load(1.0) > WAIT_IDLE["threshold"]:
        pass


def timed(cmd: list[str], env: dict, log: Path, cpu: int | None = None, cwd: Path | None = None) -> dict:
    """Run ``cmd`` to completion (optionally pinned to one CPU).

    Returns its wall time, the CPU time of it and its descendants, ``other``: the CPUs' worth of
    work that processes outside this benchmark did meanwhile (from /proc/stat), which shows when a
    measurement shared the machine, and ``ended_at`` (time.time() when it had ended).
    """
    pinned = cpu is not None and cpu >= 0
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if pinned else None
    wait_for_quiet()
    with open(log, "w") as handle:
        busy, own = busy_seconds(), own_cpu_seconds()
        started = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, preexec_fn=preexec, cwd=cwd)
        wall = time.perf_counter() - started
        ended_at = time.time()
        cpu_s = own_cpu_seconds() - own
        other = max(0.0, busy_seconds() - busy - cpu_s) / wall
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed with exit code {proc.returncode}; see {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))
    return {"wall": wall, "cpu": cpu_s, "other": other, "ended_at": ended_at}


def run_in_session(command: list[str], log, timeout: float | None, grace_seconds: float = 0.0, **popen) -> int | None:
    """Runs ``command`` with its output into the open file ``log`` and returns its exit code. Past ``timeout``
    seconds it ends every process the command started (tests/processes.py: torchrun's ranks run in sessions of
    their own, which a plain ``subprocess.run`` timeout or a process-group signal leaves running on the GPU),
    with SIGTERM and ``grace_seconds`` to clean up first where asked, else at once. Returns None when it was
    stopped."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **popen)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    sys.path.insert(0, str(PROJECT / "tests"))
    from processes import kill_tree, signal_tree

    if grace_seconds:
        signal_tree(process, signal.SIGTERM, grace_seconds)
    else:
        kill_tree(process)
    return None


def today() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(extra)
    return env


def publish(opts, section: str, text: str) -> None:
    """Print the results and, unless --no-results, rewrite this benchmark's section of RESULTS.md."""
    print()
    print(text)
    if not opts.no_results:
        update_section(opts.results, section, text)
        print(f"updated {opts.results}")


def add_common_arguments(parser, results: Path) -> None:
    """The options every benchmark script takes: waiting for quiet, scratch and results handling."""
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before each measurement wait up to S seconds for other processes to go quiet")
    parser.add_argument("--keep", action="store_true", help="keep the temporary scratch directory")
    parser.add_argument("--results", type=Path, default=results, help="results file to update")
    parser.add_argument("--no-results", action="store_true", help="print only; leave the results file alone")

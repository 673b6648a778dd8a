"""The performance guard: the standard GPU cases on this tree and on the last accepted commit's tree, one
after the other in the same call, and a failure where speed dropped or memory grew.

    git archive $(python bench/perf_guard.py --last-accepted) | (mkdir -p .carry/baseline && tar -x -C .carry/baseline)
    python bench/perf_guard.py --baseline .carry/baseline --out $OUT                 # compare
    python bench/perf_guard.py --baseline .carry/baseline --out $OUT --record        # and append if it may stand
    python bench/perf_guard.py --baseline .carry/baseline --out $OUT --record --reason "packed 4% slower: ..."
    python bench/perf_guard.py --append $OUT/perf_guard.json  # a run made on another machine, into this ledger
    python bench/perf_guard.py --append A/perf_guard.json B/perf_guard.json  # its cases over two calls: one entry

Run it on a GPU before landing a change to the train stage, the kernels, sample reading or batching
(README, *Development*). The cases, on one GPU, each with the train stage's own code:

* ``fixed128``: Qwen3.5-4B (random weights, published architecture) at 128 frames per window, fixed
  length, the train stage on one GPU (``bench/train_throughput.py --trainers ours``);
* ``packed``: the mixed-length QVHighlights-shaped set in packs of 16k tokens (``bench/packing.py
  --modes packed``), with the train stage's allocator setting for both trees (ledger entries before
  41d344b reserved the default cache's blocks: 39.7 GiB for 14 GiB allocated), the epoch's second pass
  timed when both trees can (``--passes 2``; with one pass the tree run second can find the first
  one's Triton kernels compiled on disk);
* ``plan12``: the one-GPU 12 GiB plan: the train stage under ``train.memory_cap_gib: 12`` at the frame
  count the probe plans for that card (``bench/train_throughput.py --cap-gib 12``).

Per case: tokens/s (median step after the first), step seconds, peak allocated and reserved GiB, the
step-0 loss, and MFU by this tree's bench/flops.py for both trees (shown, not judged). Machines of one
kind differ by more than the bar (the same code ran at 9,904-10,602 tokens/s at 128 frames on four
H200s, bench/RESULTS.md), so the new figures are held to the baseline
tree's, run by its own benchmark scripts in the same call on the same machine, never to figures of
another call: a case fails when its tokens/s is more than ``SPEED_DROP`` (3%) under the baseline's or
its peak reserved memory more than ``MEMORY_RISE`` (2%) over it, unless ``--reason`` says what the
change bought; then ``--record`` writes the reason into the ledger beside the figures. One machine
also drifts between runs minutes apart (4488029 ran at 12,829 and then 11,906 tokens/s at 128 frames
on one H200): ``--repeats N`` runs each case's pair N times, the tree run first alternating, and compares
the median of the pairs' tokens/s ratios (and the largest memory peaks), keeping every run's figure in the
ledger; a failing case whose runs lie further apart than the bar says so. Each run keeps what its host did
besides it (CPU time stolen by other guests, time a runnable task waited for a CPU: ``host_load``), as the
host-bound plan12 case moves with it. ``--time-limit`` keeps a call's
limit from stopping the guard mid-pair, and ``--more`` adds a later call's pairs to an earlier one's. The baseline
is the last accepted commit on this GPU model (``--last-accepted`` names it); the ledger,
``bench/perf_ledger.jsonl``, holds one line per accepted run: date, commit, machine kind, GPU and
driver, package versions, the cases' figures and the baseline's from the same call, and the reason
for any accepted loss. A changed step-0 loss is shown, not failed: a change to the math is the
golden-loss tests' business (tests/stages/test_train_verify.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "src"))
from videosft.training.setup import ALLOCATOR  # noqa: E402  (this tree's, for both trees: a baseline may predate it)
from flops import H200_BF16_PEAK  # noqa: E402  (MFU's denominator, bench/flops.py)
LEDGER = BENCH / "perf_ledger.jsonl"
SPEED_DROP = 0.03  # tokens/s may fall this much (a fraction) before the guard fails
MEMORY_RISE = 0.02  # peak reserved memory may grow this much
MODEL = BENCH / "configs" / "Qwen3.5-4B.json"
CASES = ("fixed128", "packed", "plan12")
# Steps per train-stage run, the first not counted: one run's steps of one sample length lay 0.705-1.191 s
# apart at 72 frames (bench/RESULTS.md, stop 53), so a median of five steps moved with the run. A run costs
# 69-120 s, 26-35 s of it before its first step (stop 54); ten more steps add ~10 s.
TRAIN_STEPS = 16
PACKAGES = ("torch", "triton", "transformers", "deepspeed", "peft", "fla-core")
clock = time.monotonic  # the time limit's and the runs' seconds (a test gives the guard a clock of its own)


def environment(tree: Path = ROOT) -> dict:
    """The tree's package ahead of any installed one, for the stages the cases start."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "src"), os.environ.get("PYTHONPATH")]))}


def packing_environment(tree: Path = ROOT) -> dict:
    """``environment`` with the train stage's allocator setting, unless one is set: bench/packing.py sets it
    itself only since 41d344b, so a tree from before measures its packs with the same allocator too."""
    return {**ALLOCATOR, **environment(tree)}


# ---------------------------------------------------------------- the comparison (no GPU needed)


def last_accepted(ledger: list[dict], gpu: str) -> dict | None:
    """The newest ledger entry made on this GPU model: figures from another card say nothing here."""
    same = [entry for entry in ledger if entry.get("gpu") == gpu]
    return same[-1] if same else None


def spread(runs: list[float] | None) -> float | None:
    """How far one tree's repeated runs of a case lie apart (fastest over slowest, less one)."""
    return max(runs) / min(runs) - 1 if runs and len(runs) > 1 else None


def pair_ratios(before: dict, after: dict) -> list[float]:
    """Each repeat's pair: this tree's tokens/s over the baseline's beside it (none for one run each)."""
    old_runs, new_runs = before.get("tokens_per_second_runs"), after.get("tokens_per_second_runs")
    if old_runs and new_runs and len(old_runs) == len(new_runs) > 1:
        return [new / old for old, new in zip(old_runs, new_runs)]
    return []


def speed_change(before: dict, after: dict) -> float:
    """The change in tokens/s: over repeats, the median of the pairs' ratios, as a machine drifts between
    repeats more than between a pair's two runs (plan12 on one H200: 10,274 then 12,059 tokens/s for the same
    tree, bench/RESULTS.md); else the two figures' ratio."""
    ratios = pair_ratios(before, after)
    if ratios:
        return statistics.median(ratios) - 1
    return after["tokens_per_second"] / before["tokens_per_second"] - 1


def host_sample() -> dict:
    """The host's CPU counters now: all CPUs' time and the part of it a hypervisor gave to other guests
    (``/proc/stat``'s steal, in ticks), and the microseconds in which a runnable task waited for a CPU
    (``/proc/pressure/cpu``, ``some``; None where the kernel has no pressure accounting)."""
    ticks = [int(n) for n in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    pressure = Path("/proc/pressure/cpu")
    waited = None
    if pressure.exists():
        some = pressure.read_text().splitlines()[0]
        waited = int(some.rsplit("total=", 1)[1])
    return {"at": time.monotonic(), "ticks": sum(ticks[:8]), "steal": ticks[7], "waited_us": waited}


def host_load(before: dict, after: dict) -> dict:
    """What a run's host did besides it, between two :func:`host_sample`: the share of CPU time stolen by
    other guests and the share of the run's time in which a runnable task waited for a CPU (ours or
    another's). A case bound by its host's Python (plan12: the device idle over half the step) moves with
    these; a pair whose slow run had them is the host's, not the code's."""
    ticks = after["ticks"] - before["ticks"]
    seconds = after["at"] - before["at"]
    waited = None if None in (before["waited_us"], after["waited_us"]) or seconds <= 0 else \
        round((after["waited_us"] - before["waited_us"]) / (seconds * 1e6), 4)
    return {"host_steal_share_each": round((after["steal"] - before["steal"]) / ticks, 4) if ticks > 0 else None,
            "cpu_waiting_share_each": waited}


def host_range(before: dict, after: dict) -> dict:
    """Each host figure's lowest and highest over both trees' runs of a case (none kept: absent)."""
    ranges = {}
    for figure in ("host_steal_share", "cpu_waiting_share"):
        values = [v for figures in (before, after) for v in figures.get(figure + "_runs") or [] if v is not None]
        if values:
            ranges[figure] = (min(values), max(values))
    return ranges


def compare(baseline: dict | None, new: dict) -> list[dict]:
    """One row per case and figure: the baseline's value (same call), the new one, the change and whether it
    fails the guard. ``baseline`` None: the ledger's first run, nothing to hold it to. The tokens/s row also
    holds the larger of the two trees' spreads over repeats (None for one run each)."""
    rows = []
    for case, figures in new.items():
        before = (baseline or {}).get(case, {})
        for figure, value in figures.items():
            if not isinstance(value, (int, float)):  # e.g. each repeat's tokens/s, kept in the ledger
                continue
            previous = before.get(figure)
            change = None if previous in (None, 0) or value is None else \
                speed_change(before, figures) if figure == "tokens_per_second" else value / previous - 1
            row = {"case": case, "figure": figure, "old": previous, "new": value, "change": change}
            if figure == "tokens_per_second":
                spreads = [s for s in (spread(before.get("tokens_per_second_runs")),
                                       spread(figures.get("tokens_per_second_runs"))) if s is not None]
                row["spread"] = max(spreads, default=None)
                row["pairs"] = pair_ratios(before, figures)
                row["host"] = host_range(before, figures)
            row["fails"] = change is not None and ((figure == "tokens_per_second" and change < -SPEED_DROP)
                                                   or (figure == "peak_reserved_gib" and change > MEMORY_RISE))
            rows.append(row)
    return rows


def verdict(rows: list[dict], reason: str | None) -> tuple[bool, str]:
    """Whether the run may stand (and be recorded), and why. A failing case whose runs spread more than the
    bar is named as such: more repeats tell its drop from the machine's drift (it still fails)."""
    failed = [f"{r['case']} {r['figure']} {r['change']:+.1%}" for r in rows if r["fails"]]
    if not failed:
        return True, "no case is slower by more than 3% or larger by more than 2%"
    if reason:
        return True, f"accepted with a reason ({reason}): " + ", ".join(failed)
    noisy = [f"{r['case']}'s runs lie {r['spread']:.1%} apart" for r in rows
             if r["fails"] and (r.get("spread") or 0) > SPEED_DROP]
    hint = f" ({', '.join(noisy)}, more than the bar: run it again with more --repeats)" if noisy else ""
    return False, ("regressed: " + ", ".join(failed) + hint + ". Find the cause, or say what the change buys "
                   "with --reason \"...\" (it goes into the ledger)")


def table(rows: list[dict]) -> str:
    """The rows as markdown; a tokens/s change over repeats is the pairs' median ratio, its runs' spread and
    the pairs' range beside it."""
    def note(row):
        spread = f"runs {row['spread']:.1%} apart" if row.get("spread") is not None else ""
        pairs = f"pairs {min(row['pairs']):.3f}-{max(row['pairs']):.3f}" if row.get("pairs") else ""
        host = row.get("host") or {}
        labels = {"host_steal_share": "host CPU stolen", "cpu_waiting_share": "waiting for a CPU"}
        shares = [f"{labels[key]} {low:.1%}-{high:.1%}" for key, (low, high) in host.items()]
        return "; ".join(filter(None, ["FAILS" if row["fails"] else "", spread, pairs, *shares]))

    def shown(value):
        return "-" if value is None else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"

    lines = ["| case | figure | baseline | this tree | change | |", "| --- | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['case']} | {r['figure']} | {shown(r['old'])} | {shown(r['new'])} | "
              f"{'-' if r['change'] is None else format(r['change'], '+.1%')} | {note(r)} |" for r in rows]
    return "\n".join(lines)


def read_ledger(path: Path | None = None) -> list[dict]:
    path = path or LEDGER
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append(entry: dict, path: Path | None = None) -> None:
    path = path or LEDGER
    with open(path, "a") as handle:
        handle.write(json.dumps(entry, sort_keys=True) + "\n")


# ---------------------------------------------------------------- the cases (on the GPU)


def step_figures(per_rank: dict, tokens_per_second: float, loss: float) -> dict:
    ranks = list(per_rank.values())
    return {"tokens_per_second": tokens_per_second,
            "step_seconds": statistics.median(r["step_seconds"] for r in ranks),
            "peak_allocated_gib": max(r["peak_allocated_gib"] for r in ranks),
            "peak_reserved_gib": max(r["peak_reserved_gib"] for r in ranks), "step0_loss": loss}


def train_stage_case(tree: Path, out: Path, work: Path, frames: list[int], cap_gib: float | None) -> dict:
    """The train stage on one GPU through the tree's bench/train_throughput.py; its figures at the run's
    frame count."""
    command = [sys.executable, str(tree / "bench" / "train_throughput.py"), "--config", str(tree / MODEL.relative_to(ROOT)),
               "--gpus", "1", "--steps", str(TRAIN_STEPS), "--trainers", "ours", "--no-check", "--work", str(work),
               "--out", str(out)]
    command += ["--cap-gib", str(cap_gib), "--planned-frames"] if cap_gib else ["--frames", *map(str, frames)]
    subprocess.run(command, check=True, cwd=tree, env=environment(tree))
    results = json.loads((out / "train_throughput.json").read_text())
    (frame_count, run), = results["runs"].items()
    facts = run["ours"]
    if "per_rank" not in facts:
        raise RuntimeError(f"{out}: the train stage did not run: {facts}")
    logged = logged_steps(work, int(frame_count), cap_gib)
    sample = logged.pop("sample")
    return {**step_figures(facts["per_rank"], facts["tokens_per_second"], facts["step0"]["loss"]),
            "mfu": mfu(facts["tokens_per_second"], *sample, spec_peak()), "frames": int(frame_count), **logged}


def spec_peak() -> float | None:
    """The GPU's dense bf16 peak from its spec sheet (MFU's denominator), for the GPU model bench/flops.py
    knows (the H200); None for another, whose MFU is then not given."""
    import torch

    return H200_BF16_PEAK if "H200" in torch.cuda.get_device_name(0) else None


def mfu(tokens_per_second: float, tokens: int, patches: int, peak: float | None) -> float | None:
    """Model FLOPs utilization of one GPU at a sample of ``tokens`` (``patches`` vision patches), by this
    tree's bench/flops.py for both trees: the model's FLOPs per token (the frozen base's forward and input
    gradients, not the recomputed forward) x tokens/s over ``peak``."""
    import dataclasses

    import flops

    if peak is None:
        return None
    shape = dataclasses.replace(model_shape(), tokens=tokens, patches=patches)  # as bench/packing.py counts
    return flops.utilization(tokens_per_second, shape, peak)["mfu"]


@functools.cache
def model_shape():
    """The guard's model's parameter counts (bench/flops.py), built on the meta device once per process."""
    import flops
    from transformers import AutoConfig

    return flops.shape_of(AutoConfig.from_pretrained(MODEL), 1, 0)


def logged_steps(work: Path, frames: int, cap_gib: float | None) -> dict:
    """Every step's seconds on rank 0, to tell a run's slow steps from a slow run, and the allocator's
    retries in each where the tree logs them (a step at the memory limit); the seconds before the first step;
    and the first sample's tokens and vision patches (``sample``). From the train stage's step log, where every tree's
    bench/train_throughput.py has the stage write it."""
    log = work / f"ours-{frames}-{cap_gib or 0:g}" / "steps.rank0.jsonl"
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    (t, h, w), tokens = steps[0]["grid"][0], steps[0]["input_tokens"][0]  # every step's sample is this long
    each = {"sample": (tokens, t * h * w), "step_seconds_each": [round(step["step_seconds"], 4) for step in steps],
            # the stage's start to its first step (imports, load, checks): a run's cost beyond its steps
            "start_seconds_each": round(steps[0]["since_start_s"] - steps[0]["step_seconds"], 1)}
    if all("allocator_retries" in step for step in steps):
        each["allocator_retries_each"] = [step["allocator_retries"] for step in steps]
    return each


def times_passes(tree: Path) -> bool:
    """Whether the tree's bench/packing.py runs its epoch several times and times the last (``--passes``)."""
    return "--passes" in (tree / "bench" / "packing.py").read_text()


def packing_passes(trees: list[Path]) -> int:
    """The passes both trees' packed runs make: 2 (every kernel compiled before the timed pass, so the tree
    that runs second does not time fewer compiles from Triton's disk cache) when every tree can, else 1, so
    that a tree from before ``--passes`` and this one time the same steps."""
    return 2 if all(times_passes(tree) for tree in trees) else 1


def packed_case(tree: Path, out: Path, passes: int = 1) -> dict:
    """The mixed-length set in packs, through the tree's bench/packing.py (its last JSON line is the packed
    mode's), timing the last of ``passes`` passes."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(tree / "bench" / "packing.py"), "--model-config", str(tree / MODEL.relative_to(ROOT)),
               "--device", "cuda", "--modes", "packed", "--no-results"]
    if times_passes(tree):
        command += ["--passes", str(passes)]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, env=packing_environment(tree))
    (out / "packing.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"bench/packing.py failed; its output: {out / 'packing.log'}\n{done.stderr[-2000:]}")
    shown = done.stdout
    result = [json.loads(line) for line in shown.splitlines() if line.startswith("{")][-1]
    # a pack's FLOPs: each of its windows counted as a sample of its own (bench/packing.py; an older one may
    # not count them)
    peak, model_flops = spec_peak(), result.get("model_flops_per_second")
    return {"tokens_per_second": result["tokens_per_second"], "step_seconds": result["median_step_seconds"],
            "peak_allocated_gib": result["peak_allocated_gib"], "peak_reserved_gib": result["peak_reserved_gib"],
            "step0_loss": result["first_loss"], "passes": passes,  # the pass timed: the ledger says which
            "mfu": model_flops / peak if peak and model_flops else None}


def machine() -> dict:
    """What the figures depend on besides the code: GPU model, driver, packages. SystemExit without a GPU."""
    import importlib.metadata

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("perf_guard.py: the cases run on a CUDA GPU and this machine has none; run it on the GPU "
                         "machine (bench/README.md) and bring its OUT/perf_guard.json back with --append")

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip().splitlines()
    return {"gpu": torch.cuda.get_device_name(0), "driver": driver[0] if driver else None,
            "packages": {name: version(name) for name in PACKAGES}}


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/perf_ledger.jsonl")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (" (modified)" if dirty else "")


def shared_facts(entry: dict) -> dict:
    """What the calls of one guard run share: the commit, the machine, and the baseline measured beside it."""
    return {**{key: entry[key] for key in ("commit", "kind", "gpu", "driver", "packages")},
            "baseline commit": (entry["baseline"] or {}).get("commit")}


def require_same_facts(path: Path, entry: dict, expected: dict, whose: str, why: str) -> None:
    """ValueError naming ``path`` and the first of ``shared_facts`` in which its entry differs from ``expected``."""
    for key, mine in shared_facts(entry).items():
        if mine != expected[key]:
            raise ValueError(f"{path}: its {key} ({mine}) is not {whose} ({expected[key]}); {why}")


def merged_entry(runs: list[tuple[Path, dict]]) -> dict:
    """One ledger entry from guard runs of one commit on one machine, each holding other cases (a call's
    time limit can stop one run of every case): each case's pair was measured in its own call, the
    baseline beside it. Raises ValueError naming the file and what does not fit."""
    first_path, first = runs[0]
    entry = {**first["entry"], "cases": {}, "baseline": {**(first["entry"]["baseline"] or {}), "cases": {}}}
    expected, reasons = shared_facts(first["entry"]), []
    for path, run in runs:
        if not run["ok"]:
            raise ValueError(f"{path}: that run regressed and gave no reason; it is not recorded")
        this = run["entry"]
        require_same_facts(path, this, expected, f"{first_path}'s", "one entry holds one commit measured on one "
                           "machine against one baseline")
        twice = set(this["cases"]) & set(entry["cases"])
        if twice:
            raise ValueError(f"{path}: {', '.join(sorted(twice))} is in an earlier file too; append the run to keep")
        entry["cases"].update(this["cases"])
        entry["baseline"]["cases"].update((this["baseline"] or {}).get("cases", {}))
        entry["date"] = max(entry["date"], this["date"])
        reasons += [this["reason"]] if this.get("reason") else []
    missing = [case for case in CASES if case not in entry["cases"]]
    if missing:
        files = ", ".join(str(path) for path, _ in runs)
        raise ValueError(f"{files}: no run of {', '.join(missing)}; the next guard is held to this commit in "
                         "every case, so it is recorded only with all of them "
                         f"(run --cases {' '.join(missing)} and append the files together)")
    entry["reason"] = "; ".join(reasons) or None
    if not first["entry"]["baseline"]:
        entry["baseline"] = None
    calls = sum(run["entry"].get("calls", 1) for _, run in runs)
    if calls > 1:
        entry["calls"] = calls  # the calls one after the other, each pair in one call on one machine
    return entry


def append_run(paths: list[Path]) -> int:
    """The ledger line of a run made on the GPU machine (whose own checkout is thrown away), or of several
    runs there that together hold every case, if they may stand."""
    try:
        entry = merged_entry([(path, json.loads(path.read_text())) for path in paths])
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    append(entry)
    print(f"recorded {entry['commit']} ({entry['gpu']}) in {LEDGER.relative_to(ROOT)}")
    return 0


def run_case(case: str, tree: Path, out: Path, work: Path, passes: int = 1) -> dict:
    if case == "packed":
        return packed_case(tree, out / "packed", passes)
    if case == "fixed128":
        return train_stage_case(tree, out / case, work, [128], None)
    return train_stage_case(tree, out / case, work, [], 12.0)


def repeated(runs: list[dict]) -> dict:
    """One case's figures over repeated runs: the median speed, step time and MFU, the largest memory peaks,
    the first run's loss (the same in every run), every run's tokens/s, and each run's own figures where the
    case keeps them (``step_seconds_each`` -> ``step_seconds_runs``; its wall and start-up seconds)."""
    figures = {key: value for key, value in runs[0].items() if not key.endswith("_each")}
    for middle in ("tokens_per_second", "step_seconds", "mfu"):
        values = [run[middle] for run in runs if run.get(middle) is not None]
        if values:
            figures[middle] = statistics.median(values)
    for peak in ("peak_allocated_gib", "peak_reserved_gib"):
        figures[peak] = max(run[peak] for run in runs)
    if len(runs) > 1:
        figures["tokens_per_second_runs"] = [run["tokens_per_second"] for run in runs]
    for key in [key for key in runs[0] if key.endswith("_each")]:  # e.g. step_seconds_each -> step_seconds_runs
        figures[key.removesuffix("_each") + "_runs"] = [run.get(key) for run in runs]
    return figures


def run_pairs(cases: list[str], baseline: Path | None, out: Path, work: Path, repeats: int = 1,
              runs: dict | None = None, until: float | None = None, saved=None) -> dict:
    """Every run of each case on the baseline tree and on this one (one checkpoint for both): ``repeats``
    pairs in turn (a machine drifts between runs minutes apart), the tree that runs first alternating
    (baseline first in the first repeat), so that what the run after another finds (a warmer GPU, caches)
    falls on both trees. ``runs``: an earlier call's pairs, which this call's continue (the alternation
    too). ``until``: a ``clock()`` deadline: no pair starts that the longest pair so far says would
    end past it. ``saved(runs)`` after each pair, so that a call stopped from outside keeps whole pairs."""
    runs = {case: {name: list(each) for name, each in pairs.items()} for case, pairs in (runs or {}).items()}
    longest = 0.0
    for case in cases:
        pairs = runs.setdefault(case, {"baseline": [], "this": []})
        extra = {"passes": packing_passes([ROOT] + ([baseline] if baseline else []))} if case == "packed" else {}
        done = len(pairs["this"])
        for repeat in range(done, done + repeats):
            if until is not None and clock() + longest > until:
                print(f"time limit: {case} ran {repeat - done} of {repeats} pairs in this call (the longest pair took "
                      f"{longest:.0f} s); --more OUT/perf_guard.json in the next call adds more", flush=True)
                return runs
            started = clock()
            where = f"repeat{repeat}" if repeats > 1 or repeat else "."
            order = [("baseline", baseline), ("this", ROOT)] if baseline is not None else [("this", ROOT)]
            for name, tree in order[::-1] if repeat % 2 else order:
                run_started, host = clock(), host_sample()
                run = run_case(case, tree, out / name / where, work / name, **extra)
                pairs[name].append({**run, "run_seconds_each": round(clock() - run_started, 1),
                                    **host_load(host, host_sample())})
                shared = work / "this" / "model"  # the baseline's builder makes the checkpoint, both use it
                if name == "baseline" and not shared.exists() and (work / "baseline" / "model").is_dir():
                    shared.parent.mkdir(parents=True, exist_ok=True)
                    shared.symlink_to((work / "baseline" / "model").resolve())
            longest = max(longest, clock() - started)
            print(json.dumps({case: {"repeat": repeat, "baseline": pairs["baseline"][-1] if pairs["baseline"] else None,
                                     "this": pairs["this"][-1]}}), flush=True)
            if saved:
                saved(runs)
    return runs


def figures_over_runs(runs: dict) -> tuple[dict, dict]:
    """The baseline's and this tree's figures per case over their runs (``repeated``)."""
    old = {case: repeated(pairs["baseline"]) for case, pairs in runs.items() if pairs["baseline"]}
    new = {case: repeated(pairs["this"]) for case, pairs in runs.items() if pairs["this"]}
    return old, new


def earlier_runs(path: Path, entry: dict) -> tuple[dict, int]:
    """The pairs of an earlier call of this guard run (``--more``) and how many calls made them, if that call
    measured this commit on this GPU model and drivers, packages and baseline; else ValueError naming the file."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a guard run's perf_guard.json ({error})") from None
    if "runs" not in earlier:
        raise ValueError(f"{path}: holds no runs to continue (written by a guard from before --more); "
                         "run the cases anew")
    require_same_facts(path, earlier["entry"], shared_facts(entry), "this call's", "--more continues one commit "
                       "measured against one baseline on one kind of machine")
    return earlier["runs"], earlier["entry"].get("calls", 1)


def guard_run(runs: dict, entry: dict, accepted: dict | None, reason: str | None) -> dict:
    """perf_guard.json's content: the ledger entry of these runs, the comparison's rows, the verdict, the runs."""
    old, new = figures_over_runs(runs)
    rows = compare(old if accepted else None, new)
    ok, why = verdict(rows, reason)
    entry = {**entry, "cases": new, "baseline": {"commit": accepted["commit"], "cases": old} if accepted else None}
    return {"entry": entry, "rows": rows, "ok": ok, "why": why, "runs": runs}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where each case writes its results and logs")
    parser.add_argument("--baseline", type=Path, help="a source tree of the last accepted commit (git archive)")
    parser.add_argument("--last-accepted", action="store_true",
                        help="print the last accepted commit on --gpu (the baseline to archive) and stop")
    parser.add_argument("--gpu", default="NVIDIA H200", help="the GPU model --last-accepted looks for")
    parser.add_argument("--append", type=Path, nargs="+", metavar="PERF_GUARD_JSON",
                        help="append a run made elsewhere (its OUT/perf_guard.json) to this checkout's ledger; "
                        "several: runs of one commit there that together hold every case, as one entry")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--kind", default="nvidia-h200", help="the machine kind, for the ledger")
    parser.add_argument("--record", action="store_true", help="append this run to the ledger if it may stand")
    parser.add_argument("--reason", help="what a slower or larger case buys (correctness, memory, ...)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each case's pair this many times, the first tree alternating, and compare the "
                        "pairs' median ratio (the same tree moved 17%% between two runs minutes apart on one H200)")
    parser.add_argument("--more", type=Path, metavar="PERF_GUARD_JSON",
                        help="continue an earlier call's run (its perf_guard.json): this call's --repeats pairs are "
                        "added to its pairs and everything is judged together")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="start no pair that, as long as the longest so far, would end after this many seconds; "
                        "judge the pairs run (a call's limit otherwise stops the guard before it writes anything)")
    parser.add_argument("--commit", help="the commit this tree is, where it is a copy without git (a GPU machine's)")
    parser.add_argument("--work", type=Path, help="the checkpoint and samples (default OUT/work; reused when there)")
    return parser


def report(run: dict, accepted: dict | None) -> None:
    """The guard's table and verdict on the terminal."""
    entry, calls = run["entry"], run["entry"].get("calls", 1)
    print(f"performance guard, {entry['gpu']} (driver {entry['driver']}), commit {entry['commit']}; baseline: "
          + (f"{accepted['commit']} (accepted {accepted['date']}), run beside it in "
             + (f"each of {calls} calls" if calls > 1 else "this call") if accepted
             else "none on this GPU model (this run sets the first bar)") + "\n")
    print(table(run["rows"]))
    print("\nmfu: the model's FLOPs per token (bench/flops.py: the frozen base's forward and input gradients, "
          "not the recomputed forward) x tokens/s over the GPU's spec dense bf16 peak (H200: 989 TFLOP/s); "
          "shown, not judged")
    print(f"\n{'ok' if run['ok'] else 'FAILED'}: {run['why']}")


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.append:
        return append_run(args.append)
    if args.last_accepted:
        accepted = last_accepted(read_ledger(), args.gpu)
        print(accepted["commit"] if accepted else f"none: the ledger has no entry for {args.gpu}")
        return 0 if accepted else 1
    if args.out is None:
        parser.error("--out is required to run the cases")
    until = clock() + args.time_limit if args.time_limit else None
    facts = machine()
    accepted = last_accepted(read_ledger(), facts["gpu"])
    if accepted and args.baseline is None:
        parser.error(f"--baseline is required: this tree is measured against the last accepted commit on "
                     f"{facts['gpu']}, {accepted['commit']}, in the same call (git archive {accepted['commit']} | "
                     f"tar -x -C DIR; then --baseline DIR)")
    entry = {"date": dt.date.today().isoformat(), "commit": args.commit or commit(), "kind": args.kind, **facts,
             "baseline": {"commit": accepted["commit"]} if accepted else None, "reason": args.reason}
    runs = {}
    if args.more:
        try:
            runs, calls = earlier_runs(args.more, entry)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 1
        entry["calls"] = calls + 1
    args.out.mkdir(parents=True, exist_ok=True)
    result = args.out / "perf_guard.json"

    def save(runs) -> dict:
        run = guard_run(runs, entry, accepted, args.reason)
        result.write_text(json.dumps(run, indent=1))
        return run

    run = save(run_pairs(args.cases, args.baseline.resolve() if accepted else None, args.out,
                         args.work or args.out / "work", args.repeats, runs, until, save))
    report(run, accepted)
    if run["ok"] and args.record:
        return append_run([result])
    return 0 if run["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

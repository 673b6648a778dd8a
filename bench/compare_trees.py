"""The same train step from two source trees, one after the other on one GPU: where a speed change came from.

    git archive 4488029 | tar -x -C /tmp/old
    python bench/compare_trees.py --tree old=/tmp/old --tree main=. --frames 128 --steps 6 \
        --runs main:ours old:ours main:ours+profile old:ours+profile main:ours+env:VIDEOSFT_AUTOTUNE=full --out $OUT

Each run is that tree's own ``bench/train_throughput.py --trainers <trainer>`` (its own sample
builder, train stage and kernels) on one checkpoint, built once from the first tree's builder and
shared. A run's name is ``tree:trainer`` plus options: ``+profile`` profiles the step before the last
(``train.profile_step``; that step and the cProfiled last one are left out of its figures),
``+env:NAME=VALUE`` sets an environment variable; ``--cap-gib 12 --frames 72`` is the guard's plan12
case. ``--run-timeout SECONDS`` stops a run that outlasts it (a tree building its samples or autotuning for
longer than the call has) and goes on with the next. Per run: its wall seconds, tokens/s and step seconds
(median of the unprofiled steps after the first), every step's seconds (and its wait for its batch and
allocator retries, where the tree logs them), peak memory; a profiled run adds the device's busy time in
the profiled step, its idle gaps charged to host work (``bench/trace_summary.py``), and the operator table.
Written to OUT: ``compare_trees.json`` and ``profiles.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _shared import run_in_session  # noqa: E402
from trace_summary import load_events, summarize  # noqa: E402

# Runs a tree's train_throughput with one extra trainer (the named one plus train / env overrides).
WRAPPER = r'''
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, "bench")
import train_throughput as bench
bench.TRAINERS[spec["name"]] = {**bench.TRAINERS[spec["trainer"]], "train": spec["train"], "env": spec["env"]}
sys.argv = ["train_throughput.py", *sys.argv[2:]]
bench.main()
'''


def parse_run(text: str) -> dict:
    tree, _, rest = text.partition(":")
    trainer, *options = rest.split("+")
    run = {"label": text, "tree": tree, "trainer": trainer, "profile": False, "env": {}}
    for option in options:
        if option == "profile":
            run["profile"] = True
        elif option.startswith("env:") and "=" in option:
            name, value = option[4:].split("=", 1)
            run["env"][name] = value
        else:
            raise SystemExit(f"--runs {text}: unknown option {option!r} (profile, env:NAME=VALUE)")
    return run


def run_labels(runs: list[dict]) -> list[str]:
    """Each run's key in the results: its text, numbered from the second run of the same text on (``old:ours``,
    ``old:ours #2``), so that a pair run twice to see the machine's drift keeps every figure."""
    seen: dict[str, int] = {}
    labels = []
    for run in runs:
        seen[run["label"]] = seen.get(run["label"], 0) + 1
        labels.append(run["label"] if seen[run["label"]] == 1 else f"{run['label']} #{seen[run['label']]}")
    return labels


def run_one(run: dict, tree: Path, args, model: Path, out: Path, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if not (work / "model").exists() and model.exists():
        (work / "model").symlink_to(model)
    train = {"profile_step": args.steps - 2} if run["profile"] else {}
    spec = {"name": "compared", "trainer": run["trainer"], "train": train, "env": run["env"]}
    command = [sys.executable, "-c", WRAPPER, json.dumps(spec), "--config", str(tree / "bench/configs/Qwen3.5-4B.json"),
               "--frames", str(args.frames), "--gpus", "1", "--steps", str(args.steps), "--trainers", "compared",
               "--no-check", "--work", str(work), "--out", str(out)]
    command += ["--cap-gib", str(args.cap_gib)] if args.cap_gib else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")])}
    log = out / "output.log"
    with open(log, "w") as handle:
        code = run_in_session(command, handle, args.run_timeout, cwd=tree, env=env)
    if code is None:  # stuck (building or autotuning past the call's time): the call goes on with the next run
        tail = log.read_text(errors="replace")[-1200:]
        return {"failed": f"stopped after {args.run_timeout:g} s (--run-timeout); its last lines: {tail}"}
    results = json.loads((out / "train_throughput.json").read_text()) if (out / "train_throughput.json").exists() else {}
    facts = results.get("runs", {}).get(str(args.frames), {}).get("compared", {})
    if "per_rank" not in facts:
        return {"failed": facts.get("failed") or log.read_text(errors="replace")[-1500:]}
    train_out = work / f"compared-{args.frames}-{args.cap_gib:g}"
    steps = [json.loads(line) for line in (train_out / "steps.rank0.jsonl").read_text().splitlines()]
    timed = steps[1:-2] if run["profile"] else steps[1:]
    figures = {"tokens_per_second": statistics.median(s["tokens_per_second"] for s in timed),
               "step_seconds": statistics.median(s["step_seconds"] for s in timed),
               "all_step_seconds": [round(s["step_seconds"], 3) for s in steps],
               "peak_allocated_gib": facts["per_rank"]["0"]["peak_allocated_gib"] if "0" in facts["per_rank"]
               else facts["per_rank"][0]["peak_allocated_gib"],
               "input_tokens": steps[0]["input_tokens"], "step0_loss": steps[0]["loss"]}
    for key in ("batch_wait_seconds", "allocator_retries"):  # where the tree logs them: data late, memory full
        if all(key in s for s in steps):
            figures[key] = [round(s[key], 3) for s in steps]
    # no MFU: each tree's train_throughput has its own definition (4488029's counted the recomputed forward)
    if (train_out / "autotune.json").exists():  # the choices this run's autotuning made, a table to ship
        shutil.copy(train_out / "autotune.json", out / "autotune.json")
    if run["profile"]:
        for path in train_out.glob("profile.rank0*"):
            shutil.copy(path, out / path.name)
        trace = train_out / "profile.rank0.trace.json.gz"
        if trace.exists():
            summary = summarize(load_events(trace))
            (out / "trace_summary.json").write_text(json.dumps(summary, indent=1, default=str))
            figures["trace"] = {key: summary[key] for key in summary if not isinstance(summary[key], (list, dict))}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree")
    parser.add_argument("--runs", nargs="+", required=True, help="tree:trainer[+profile][+env:NAME=VALUE] ...")
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cap-gib", type=float, default=0.0,
                        help="each run under train.memory_cap_gib (a card of this size), e.g. 12 with --frames 72: "
                        "the performance guard's plan12 case")
    parser.add_argument("--work", type=Path, help="one checkpoint and sample folder for every run (trees whose "
                        "sample stores agree); default one per tree")
    parser.add_argument("--run-timeout", type=float, metavar="SECONDS",
                        help="stop a run past this many seconds (with the processes it started) and go on with the "
                        "next; the run is reported as stopped, with its last lines")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    runs = [parse_run(text) for text in args.runs]
    unknown = {r["tree"] for r in runs} - set(trees)
    if unknown:
        raise SystemExit(f"--runs name trees not given with --tree: {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "compare_trees"
    shutil.rmtree(scratch, ignore_errors=True)
    model = scratch / "model"
    results = {}
    for number, (run, label) in enumerate(zip(runs, run_labels(runs))):
        out = scratch / f"run{number}"
        work = args.work or scratch / f"work-{run['tree']}"
        started = time.monotonic()
        results[label] = figures = run_one(run, trees[run["tree"]], args, model, out, work)
        figures["wall_seconds"] = round(time.monotonic() - started, 1)  # what the run cost the call, start-up included
        built = (work / "model" / "model.safetensors.index.json").exists()  # written last: a stopped build has none
        if not model.exists() and built and not (work / "model").is_symlink():
            shutil.move(str(work / "model"), model)  # the first build serves every later run
            (work / "model").symlink_to(model)
        print(json.dumps({label: figures}, default=str), flush=True)
        (args.out / "compare_trees.json").write_text(json.dumps(results, indent=1, default=str))
        with tarfile.open(args.out / "profiles.tar.gz", "w:gz") as packed:  # after each run: a timeout keeps them
            for path in sorted(scratch.glob("run*/*")):
                if path.is_file():
                    packed.add(path, arcname=f"{path.parent.name}/{path.name}")
    capped = f" capped at {args.cap_gib:g} GiB" if args.cap_gib else ""
    print(f"\n{args.frames} frames, one GPU{capped}, {args.steps} steps "
          "(median of the unprofiled steps after the first)")
    print("| run | tokens/s | step s | steps (s) | peak alloc GiB | step-0 loss | device busy in the profiled step |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- |")
    for label, f in results.items():
        if "failed" in f:
            print(f"| {label} | failed: {f['failed'][-200:]!r} |")
            continue
        trace = f.get("trace", {})
        busy = ", ".join(f"{k} {v:.4g}" for k, v in trace.items()) if trace else "-"
        print(f"| {label} | {f['tokens_per_second']:,.0f} | {f['step_seconds']:.3f} | {f['all_step_seconds']} | "
              f"{f['peak_allocated_gib']:.2f} | {f['step0_loss']:.5f} | {busy} |")


if __name__ == "__main__":
    main()

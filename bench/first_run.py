"""Measurements on one GPU: a first train run with an empty Triton cache, broken down, then the
same run with the now-warm cache; optionally verify's merged-vs-unmerged logits by kernel path and precision.

    python bench/first_run.py --code-root .whl/head --frames 64 --steps 4 --runs cold warm \\
        --work /tmp/g18 --out $OUT --deadline-s 560 [--part2]

The checkpoint (random bf16 weights from bench/configs/Qwen3.5-4B.json), the samples and the probe are
made with bench/gpu_pipeline.py's own functions; the train stage runs as `torchrun -m videosft.stages.train`
would, through bench/first_run_train.py, which records imports, phases, every kernel-check run,
every Triton compile and autotune (events in WORK/events-<run>.rank0.jsonl). Each run has its own
TRITON_CACHE_DIR=WORK/triton (emptied before "cold"), TRITON_PRINT_AUTOTUNING=1.
--part2 then runs bench/verify_precision.py: fp32 (torch / fla Gated-DeltaNet, TF32 off / on),
bf16 (torch / fla), and fp32 with fla's matrix products in ieee fp32, on the val sample, with the
train run's adapter (or --adapter). Everything ends in OUT/gpu18.json, logs in OUT/logs.tgz;
a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from collections import defaultdict
from pathlib import Path

from _shared import run_in_session

HERE = Path(__file__).resolve().parent
WARM_RESERVE_S = 70
STARTED = time.time()


def remaining(deadline: float) -> float:
    return deadline - (time.time() - STARTED)


def launch(command: list[str], log: Path, env: dict, timeout: float) -> dict:
    started = time.time()
    with open(log, "w") as handle:  # past its timeout the rank torchrun started is stopped with it
        code = run_in_session(command, handle, timeout, env=env)
    code = "timeout" if code is None else code
    return {"returncode": code, "wall_seconds": time.time() - started, "timeout_s": timeout}


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def summarize(events: list[dict]) -> dict:
    """Launch-relative times of each phase; Triton compile / autotune seconds per phase, kernel and key."""
    out: dict = {"imports": {}, "phases": {}, "steps": [], "check_runs": [], "helpers": defaultdict(float)}
    for e in events:
        kind = e["kind"]
        if kind == "process_start":
            out["process_start_s"] = e["t"]
        elif kind == "import":
            out["imports"][e["module"]] = round(e["seconds"], 2)
        elif kind == "train_main_start":
            out["train_main_start_s"] = e["t"]
        elif kind == "phase_end":
            out["phases"].setdefault(e["name"], {}).update(
                end_s=e["t"], seconds=round(e["seconds"], 2),
                **{k: round(v, 3) for k, v in e.items() if k.endswith("_gib") and not k.startswith("before_")})
        elif kind == "phase_start":
            phase = out["phases"].setdefault(e["name"], {})
            phase["start_s"] = e["t"]
            phase.update({k: round(v, 3) for k, v in e.items() if k.startswith("before_")})
        elif kind == "step_start":
            out["steps"].append({"step": e["step"], "start_s": e["t"]})
        elif kind == "step_end":
            for step in out["steps"]:
                if step["step"] == e["step"]:
                    step.update(end_s=e["t"], seconds=round(e["t"] - step["start_s"], 2),
                                peak_allocated_gib=e.get("peak_allocated_gib"))
        elif kind == "check_run":
            out["check_runs"].append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in e.items()
                                      if k not in ("kind",)})
        elif kind == "helper":
            out["helpers"][e["name"]] += e["seconds"]
        elif kind == "train_main_end":
            out["keys_used"] = e.get("keys_used", {})
    # where the compile / autotune time went: by top-level phase and by check run
    compile_by = defaultdict(lambda: {"compiles": 0, "compile_s": 0.0, "autotunes": 0, "autotune_s": 0.0,
                                      "autotune_bench_s": 0.0, "compile_in_autotune_s": 0.0})
    kernels = defaultdict(lambda: {"compiles": 0, "compile_s": 0.0, "autotunes": 0, "autotune_s": 0.0, "phases": set()})
    autotunes = []
    for e in events:
        if e["kind"] not in ("compile", "autotune"):
            continue
        top = e["phase"].split(":")[0] if ":" in e["phase"] else e["phase"]
        bucket = compile_by[e["phase"]]
        k = kernels[e["kernel"]]
        k["phases"].add(top)
        if e["kind"] == "compile":
            bucket["compiles"] += 1
            if e["in_autotune"]:
                bucket["compile_in_autotune_s"] += e["seconds"]
            else:
                bucket["compile_s"] += e["seconds"]
                k["compile_s"] += e["seconds"]
            k["compiles"] += 1
        else:
            bucket["autotunes"] += 1
            bucket["autotune_s"] += e["seconds"]
            bucket["autotune_bench_s"] += e["bench_seconds"] or 0.0
            k["autotunes"] += 1
            k["autotune_s"] += e["seconds"]
            autotunes.append({"kernel": e["kernel"], "key": e["key"], "phase": e["phase"], "t": e["t"],
                              "seconds": round(e["seconds"], 2), "bench_seconds": e["bench_seconds"],
                              "configs": e["configs"], "from_disk_cache": e["from_disk_cache"]})
    out["triton_by_phase"] = {p: {k: round(v, 2) if isinstance(v, float) else v for k, v in b.items()}
                              for p, b in compile_by.items()}
    out["triton_by_kernel"] = sorted(({"kernel": n, **{k: (round(v, 2) if isinstance(v, float) else
                                                          sorted(v) if isinstance(v, set) else v)
                                                       for k, v in b.items()}} for n, b in kernels.items()),
                                     key=lambda r: -(r["compile_s"] + r["autotune_s"]))
    out["autotunes"] = sorted(autotunes, key=lambda r: -r["seconds"])
    used = out.get("keys_used", {})
    in_steps = {tuple(k) for k in used.get("step", [])}
    in_checks = {tuple(k) for k in used.get("check", [])}
    only_checks = [a for a in autotunes if (a["kernel"], a["key"]) in in_checks and (a["kernel"], a["key"]) not in in_steps]
    out["autotune_keys"] = {"used_in_checks": len(in_checks), "used_in_steps": len(in_steps),
                            "only_in_checks": len(in_checks - in_steps), "only_in_steps": len(in_steps - in_checks),
                            "seconds_tuning_keys_only_checks_use": round(sum(a["seconds"] for a in only_checks), 2),
                            "keys_only_checks_use": sorted({f"{a['kernel']} {a['key']}" for a in only_checks})}
    out["helpers"] = {k: round(v, 2) for k, v in out["helpers"].items()}
    return out


def directory_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code-root", type=Path, default=HERE.parent, help="project tree to run (a HEAD snapshot)")
    parser.add_argument("--config", default="bench/configs/Qwen3.5-4B.json", help="relative to --code-root")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", nargs="*", default=["cold", "warm"], help="cold = empty Triton cache first")
    parser.add_argument("--work", type=Path, default=Path("/tmp/g18"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=560)
    parser.add_argument("--part2", action="store_true")
    parser.add_argument("--part2-sets", nargs="*", default=["fp32", "bf16", "fp32-ieee"])
    parser.add_argument("--adapter", type=Path, default=None, help="adapter for part 2 (default: the train run's)")
    parser.add_argument("--triton-cache-tgz", type=Path, default=None, help="extract into WORK/triton first")
    parser.add_argument("--save-cache", action="store_true", help="OUT/triton.tgz of the cache at the end")
    args = parser.parse_args()
    code_root = args.code_root.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    results: dict = {"code_root": str(code_root), "frames": args.frames, "steps": args.steps, "runs": {},
                     "commit": (code_root / "COMMIT").read_text().strip() if (code_root / "COMMIT").exists() else None}

    t = time.time()
    sys.path[:0] = [str(code_root / "src"), str(code_root / "bench")]
    import gpu_pipeline as gp  # noqa: E402  (imports videosft from code_root)

    results["driver_import_seconds"] = time.time() - t
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(code_root / "src")]).strip(os.pathsep)}

    model_dir = args.work / "model"
    if not (model_dir / "model.safetensors.index.json").exists():
        results["checkpoint"] = gp.build_checkpoint(code_root / args.config, model_dir)
    cfg = gp.config_lib.resolve({
        "data": {"max_length": 32768}, "model": {"path": str(model_dir)},
        "video": {"fps": args.frames / 32.0, "min_frames": 4, "max_frames": args.frames, "min_tokens": 4,
                  "max_tokens": 196},
        "train": {"steps": args.steps, "deepspeed_config": str(code_root / "workflow/deepspeed/zero3.json"),
                  "timeout_s": 600},
        "memory": {"world_sizes": [1, 2, 4]}, "verify": {"forward_samples": 1},
    })
    samples_dir = args.work / f"preprocess-{args.frames}f-1gpus"
    manifest = samples_dir / "manifest.json"
    if not manifest.exists():
        t = time.time()
        results["samples"] = gp.build_samples(cfg, samples_dir, 3, 32.0, 18)
        results["samples_seconds"] = time.time() - t
    probe_out = samples_dir / "probe"
    if not (probe_out / "probe.json").exists():
        results["probe"] = launch([sys.executable, "-m", "videosft.stages.probe", "--config", gp.stage_config("probe", cfg),
                                   "--samples", str(manifest), "--out", str(probe_out)], logs / "probe.log", env,
                                  max(30, remaining(args.deadline_s) - 30))
    results["setup_seconds"] = time.time() - STARTED

    cache = args.work / "triton"
    if args.triton_cache_tgz and args.triton_cache_tgz.exists():
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        with tarfile.open(args.triton_cache_tgz) as archive:
            archive.extractall(cache)
    for index, label in enumerate(args.runs):
        # the cold run first; each later run keeps WARM_RESERVE_S for itself; part 2 gets what is left
        left = remaining(args.deadline_s) - (WARM_RESERVE_S if index + 1 < len(args.runs) else 10)
        if left < 30:
            results["runs"][label] = {"skipped": f"deadline ({left:.0f} s left)"}
            continue
        if label == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        files_before = directory_size(cache)
        out = samples_dir / f"train-{label}"
        shutil.rmtree(out, ignore_errors=True)
        events = args.work / f"events-{label}"
        for old in args.work.glob(f"events-{label}.rank*.jsonl"):
            old.unlink()
        run_env = {**env, "TRITON_CACHE_DIR": str(cache), "TRITON_PRINT_AUTOTUNING": "1",
                   "GPU18_EVENTS": str(events), "GPU18_LAUNCH_T0": repr(time.time())}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   str(HERE / "first_run_train.py"), "--config", gp.stage_config("train", cfg),
                   "--samples", str(manifest), "--probe", str(probe_out / "probe.json"), "--out", str(out)]
        run = launch(command, logs / f"train-{label}.log", run_env, left)
        run["cache_files_before"], run["cache_bytes_before"] = files_before
        run["cache_files_after"], run["cache_bytes_after"] = directory_size(cache)
        run["summary"] = summarize(read_events(Path(f"{events}.rank0.jsonl")))
        steps_file = out / "steps.rank0.jsonl"
        if steps_file.exists():
            run["steps_log"] = [{k: s[k] for k in ("step", "loss", "step_seconds", "peak_allocated_gib",
                                                   "peak_reserved_gib", "input_tokens") if k in s}
                                for s in map(json.loads, steps_file.read_text().splitlines())]
        record = out / "run_record.json"
        if record.exists():
            facts = json.loads(record.read_text()).get("results", {})
            kernels = facts.get("kernels", {})
            run["record"] = {"load": facts.get("load"), "gdn_check_seconds": kernels.get("gated_deltanet", {}).get("check_seconds"),
                             "fused_check_seconds": kernels.get("fused", {}).get("check_seconds"),
                             "gdn_checks": kernels.get("gated_deltanet", {}).get("checks"),
                             "fused_checks": kernels.get("fused", {}).get("checks"),
                             "memory": facts.get("memory")}
        results["runs"][label] = run
        (args.out / "gpu18.json").write_text(json.dumps(results, indent=2, default=str))

    adapter = args.adapter
    trained = samples_dir / "train-cold" / "adapter"
    if adapter is None:
        adapter = trained if (trained / "adapter_model.safetensors").exists() else \
            samples_dir / "train-warm" / "adapter"
    if (adapter / "adapter_model.safetensors").exists():
        with tarfile.open(args.out / "adapter.tgz", "w:gz") as archive:
            archive.add(adapter, arcname="adapter")
    results["part2"] = {}
    if args.part2:
        sets = {"fp32": ["--dtype", "fp32", "--variants", "torch:tf32off", "fla:tf32off", "torch:tf32on", "fla:tf32on"],
                "bf16": ["--dtype", "bf16", "--variants", "torch:tf32off", "fla:tf32off"],
                "fp32-ieee": ["--dtype", "fp32", "--fla-ieee", "--variants", "fla:tf32off", "torch:tf32off"]}
        if not (adapter / "adapter_model.safetensors").exists():
            adapter = args.work / "adapter-random"
        part2_env = {**env, "TRITON_CACHE_DIR": str(cache), "TRITON_PRINT_AUTOTUNING": "1"}
        for name in args.part2_sets:
            left = remaining(args.deadline_s) - 10
            if left < 60:
                results["part2"][name] = {"skipped": f"deadline ({left:.0f} s left)"}
                continue
            report = args.work / f"verify-{name}.json"
            run = launch([sys.executable, str(HERE / "verify_precision.py"), "--code-root", str(code_root),
                          "--model", str(model_dir), "--manifest", str(manifest), "--adapter", str(adapter),
                          *sets[name], "--out", str(report)], logs / f"verify-{name}.log", part2_env, left)
            if report.exists():
                run["result"] = json.loads(report.read_text())
            results["part2"][name] = run
            (args.out / "gpu18.json").write_text(json.dumps(results, indent=2, default=str))

    results["triton_cache"] = dict(zip(("files", "bytes"), directory_size(cache))) if cache.exists() else None
    if args.save_cache and cache.exists():
        with tarfile.open(args.out / "triton.tgz", "w:gz") as archive:
            archive.add(cache, arcname=".")
        results["triton_tgz_bytes"] = (args.out / "triton.tgz").stat().st_size
        if results["triton_tgz_bytes"] > 15 * 2**20:
            (args.out / "triton.tgz").unlink()
            results["triton_tgz_dropped"] = "over 15 MiB"
    with tarfile.open(args.out / "logs.tgz", "w:gz") as archive:
        archive.add(logs, arcname="logs")
        for events in args.work.glob("events-*.jsonl"):
            archive.add(events, arcname=f"events/{events.name}")
        for label in results["runs"]:
            for name in ("run_record.json", "steps.rank0.jsonl"):
                path = samples_dir / f"train-{label}" / name
                if path.exists():
                    archive.add(path, arcname=f"train-{label}/{name}")
        if (probe_out / "probe.json").exists():
            archive.add(probe_out / "probe.json", arcname="probe.json")
    results["total_seconds"] = time.time() - STARTED
    (args.out / "gpu18.json").write_text(json.dumps(results, indent=2, default=str))
    print_table(results)


def print_table(results: dict) -> None:
    print("\n=== gpu18: first-run breakdown (seconds since torchrun launch) ===")
    print(f"setup (checkpoint / samples / probe) {results['setup_seconds']:.1f} s; checkpoint "
          f"{results.get('checkpoint')}; probe {results.get('probe', {}).get('wall_seconds')}")
    for label, run in results["runs"].items():
        if "summary" not in run:
            print(f"{label}: {run}")
            continue
        s = run["summary"]
        phases = s["phases"]
        print(f"\n[{label}] rc {run['returncode']} wall {run['wall_seconds']:.1f} s; cache files "
              f"{run['cache_files_before']} -> {run['cache_files_after']} ({run['cache_bytes_after'] / 2**20:.1f} MiB)")
        print(f"  process start {s.get('process_start_s')}; imports {s['imports']}; train main at {s.get('train_main_start_s')}")
        for name, p in phases.items():
            print(f"  {name:22s} {p.get('start_s', 0):7.1f} -> {p.get('end_s', 0):7.1f}  {p.get('seconds', 0):7.2f} s  "
                  f"alloc before {p.get('before_allocated_gib', '-')} peak {p.get('peak_gib', '-')} GiB")
        for step in s["steps"]:
            print(f"  step {step['step']}: {step['start_s']:.1f} -> {step.get('end_s', float('nan')):.1f} "
                  f"({step.get('seconds')} s, peak {step.get('peak_allocated_gib')})")
        print("  triton by phase (compile s / autotune s incl. its compiles / autotune bench s):")
        for phase, b in sorted(s["triton_by_phase"].items(), key=lambda kv: -(kv[1]["compile_s"] + kv[1]["autotune_s"]))[:25]:
            print(f"    {phase:55s} compiles {b['compiles']:4d} {b['compile_s']:7.1f} (+{b['compile_in_autotune_s']:.1f} in "
                  f"autotunes) | autotunes {b['autotunes']:3d} {b['autotune_s']:7.1f} (bench {b['autotune_bench_s']:.1f})")
        print("  check runs:")
        for r in s["check_runs"]:
            print(f"    {r['what']:22s} {r['role']:22s} T={r['tokens']:5d} {r['seconds']:7.2f} s  alloc "
                  f"{r.get('before_allocated_gib')} -> {r.get('allocated_gib')} peak {r.get('peak_gib')}")
        print(f"  autotune keys: {s['autotune_keys']}")
        print("  top autotunes:")
        for a in s["autotunes"][:12]:
            print(f"    {a['kernel']:40s} {a['key'][:60]:60s} {a['seconds']:6.2f} s  {a['phase']}")
    for name, run in results.get("part2", {}).items():
        print(f"\n[verify {name}] rc {run.get('returncode')} wall {run.get('wall_seconds', 0):.0f} s")
        res = run.get("result") or {}
        print(f"  weights {res.get('weights_allocated_gib')} GiB, tokens {res.get('tokens')}, lora {res.get('lora')}")
        for v in res.get("variants", []):
            for smp in v["per_sample"]:
                print(f"  {v['variant']:14s} max|d| {smp['max_abs_difference']:.3e} mean {smp['mean_abs_difference']:.2e} "
                      f"repeat {smp['repeat_max_abs_difference']:.1e} |logit|max {smp['logits_abs_max']:.3f} rms "
                      f"{smp['logits_rms']:.3f} vs {smp['vs_first_variant']['variant']} "
                      f"{smp['vs_first_variant']['max_abs_difference']:.2e} fwd peak {smp['one_forward_peak_gib']:.2f} "
                      f"cmp peak {smp['comparison_peak_gib']:.2f} GiB t {smp['first_forward_seconds']:.1f}/{smp['second_forward_seconds']:.1f}")


if __name__ == "__main__":
    main()

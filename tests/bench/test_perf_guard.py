"""The performance guard's judgement, on recorded figures (the cases themselves need a GPU), and the ledger."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import perf_guard  # noqa: E402

OLD = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-01",
       "cases": {"fixed128": {"tokens_per_second": 12000.0, "peak_reserved_gib": 10.0, "step0_loss": 12.85}}}


def new(tokens_per_second: float, reserved: float) -> dict:
    return {"fixed128": {"tokens_per_second": tokens_per_second, "peak_reserved_gib": reserved, "step0_loss": 12.85}}


def failing(rows):
    return [(row["case"], row["figure"]) for row in rows if row["fails"]]


def test_a_drop_over_three_percent_or_a_rise_over_two_fails():
    assert failing(perf_guard.compare(OLD["cases"], new(11_600, 10.0))) == [("fixed128", "tokens_per_second")]  # -3.3%
    assert failing(perf_guard.compare(OLD["cases"], new(11_700, 10.0))) == []  # -2.5%
    assert failing(perf_guard.compare(OLD["cases"], new(12_000, 10.25))) == [("fixed128", "peak_reserved_gib")]  # +2.5%
    assert failing(perf_guard.compare(OLD["cases"], new(13_000, 10.15))) == []  # faster, +1.5% memory
    loss = next(r for r in perf_guard.compare(OLD["cases"], new(12_000, 10.0)) if r["figure"] == "step0_loss")
    assert loss["change"] == 0 and not loss["fails"]  # shown, never failed: the golden-loss tests judge the math


def test_a_regression_stands_only_with_a_reason_and_the_first_run_sets_the_bar():
    rows = perf_guard.compare(OLD["cases"], new(11_000, 10.0))
    ok, why = perf_guard.verdict(rows, None)
    assert not ok and "fixed128 tokens_per_second -8.3%" in why and "--reason" in why
    ok, why = perf_guard.verdict(rows, "exact per-sample losses")
    assert ok and why.startswith("accepted with a reason (exact per-sample losses)")
    first = perf_guard.compare(None, new(11_000, 10.0))
    assert all(row["old"] is None and row["change"] is None for row in first) and perf_guard.verdict(first, None)[0]


def test_the_bar_is_the_newest_entry_of_the_same_gpu_model(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    for entry in (OLD, {**OLD, "commit": "def5678"}, {**OLD, "gpu": "NVIDIA H100", "commit": "0000000"}):
        perf_guard.append(entry, ledger)
    entries = perf_guard.read_ledger(ledger)
    assert len(entries) == 3 and perf_guard.last_accepted(entries, "NVIDIA H200")["commit"] == "def5678"
    assert perf_guard.last_accepted(entries, "NVIDIA A100") is None
    shown = perf_guard.table(perf_guard.compare(entries[1]["cases"], new(11_000, 10.0)))
    assert "| fixed128 | tokens_per_second | 12,000 | 11,000 | -8.3% | FAILS |" in shown


def test_the_baseline_to_archive_is_the_last_accepted_commit_of_the_gpu_model(tmp_path, monkeypatch, capsys):
    ledger = tmp_path / "perf_ledger.jsonl"
    monkeypatch.setattr(perf_guard, "LEDGER", ledger)
    assert perf_guard.main(["--last-accepted"]) == 1 and "no entry for NVIDIA H200" in capsys.readouterr().out
    for entry in (OLD, {**OLD, "commit": "def5678"}, {**OLD, "gpu": "NVIDIA H100", "commit": "0000000"}):
        perf_guard.append(entry, ledger)
    assert perf_guard.main(["--last-accepted"]) == 0 and capsys.readouterr().out.strip() == "def5678"
    assert perf_guard.main(["--last-accepted", "--gpu", "NVIDIA H100"]) == 0
    assert capsys.readouterr().out.strip() == "0000000"


def test_every_ledger_entry_is_a_real_run_with_its_machine_and_all_its_figures():
    """The committed ledger holds only runs made on a GPU: a test's made-up entry there would become the bar."""
    entries = perf_guard.read_ledger()
    assert entries, "the ledger has its first entry"
    figures = {"tokens_per_second", "step_seconds", "peak_allocated_gib", "peak_reserved_gib", "step0_loss"}
    for entry in entries:
        assert entry["driver"] and entry["kind"].startswith("nvidia-") and entry["gpu"].startswith("NVIDIA")
        assert set(entry["packages"]) == set(perf_guard.PACKAGES) and all(entry["packages"].values())
        assert set(entry["cases"]) == set(perf_guard.CASES), entry["commit"]
        for case, values in entry["cases"].items():
            assert figures <= set(values) and values["tokens_per_second"] > 0, (entry["commit"], case)


def guard_run(cases: dict, ok: bool = True, **entry) -> dict:
    """What a guard run writes to OUT/perf_guard.json, with the baseline's figures of the same call."""
    machine = {"kind": "nvidia-h200", "gpu": "NVIDIA H200", "driver": "580.159.04", "packages": {"torch": "2.11.0"}}
    return {"ok": ok, "rows": [], "entry": {**machine, "commit": "abc1234", "date": "2026-12-03", "reason": None,
                                            "cases": cases, "baseline": {"commit": "0ld0000", "cases": cases},
                                            **entry}}


def figures(tokens_per_second: float) -> dict:
    return {"tokens_per_second": tokens_per_second, "peak_reserved_gib": 10.0, "step0_loss": 12.85}


EVERY_CASE = {case: figures(10_000.0 + i) for i, case in enumerate(perf_guard.CASES)}


def write(path: Path, run: dict) -> Path:
    path.write_text(json.dumps(run))
    return path


def test_a_run_from_the_gpu_machine_is_appended_only_if_it_may_stand(tmp_path, monkeypatch, capsys):
    ledger = tmp_path / "perf_ledger.jsonl"
    monkeypatch.setattr(perf_guard, "LEDGER", ledger)
    monkeypatch.setattr(perf_guard, "ROOT", tmp_path)
    bad = write(tmp_path / "bad.json", guard_run(EVERY_CASE, ok=False, commit="bad0000"))
    assert perf_guard.main(["--append", str(bad)]) == 1 and not ledger.exists()
    assert "bad.json: that run regressed and gave no reason" in capsys.readouterr().err
    partial = write(tmp_path / "partial.json", guard_run({"packed": EVERY_CASE["packed"]}))
    assert perf_guard.main(["--append", str(partial)]) == 1 and not ledger.exists()
    assert "no run of fixed128, plan12" in capsys.readouterr().err
    whole = write(tmp_path / "whole.json", guard_run(EVERY_CASE))
    assert perf_guard.main(["--append", str(whole)]) == 0
    (entry,) = perf_guard.read_ledger(ledger)
    assert entry["commit"] == "abc1234" and entry["cases"] == EVERY_CASE and "calls" not in entry


def test_runs_of_one_commit_over_several_calls_make_one_entry_with_every_case(tmp_path, monkeypatch, capsys):
    """A call's ten minutes hold one or two of the cases' pairs: each pair in its own call, one entry."""
    ledger = tmp_path / "perf_ledger.jsonl"
    monkeypatch.setattr(perf_guard, "LEDGER", ledger)
    monkeypatch.setattr(perf_guard, "ROOT", tmp_path)
    packed = write(tmp_path / "a.json", guard_run({"packed": EVERY_CASE["packed"]}, date="2026-12-03"))
    fixed = write(tmp_path / "b.json", guard_run({"fixed128": EVERY_CASE["fixed128"]}, reason="exact losses"))
    plan = write(tmp_path / "c.json", guard_run({"plan12": EVERY_CASE["plan12"]}, date="2026-12-04"))
    other = write(tmp_path / "d.json", guard_run({"plan12": EVERY_CASE["plan12"]}, driver="590.1"))
    assert perf_guard.main(["--append", str(packed), str(fixed), str(other)]) == 1 and not ledger.exists()
    assert "d.json: its driver (590.1) is not" in capsys.readouterr().err
    assert perf_guard.main(["--append", str(packed), str(fixed), str(packed)]) == 1 and not ledger.exists()
    assert "packed is in an earlier file too" in capsys.readouterr().err
    assert perf_guard.main(["--append", str(packed), str(fixed), str(plan)]) == 0
    (entry,) = perf_guard.read_ledger(ledger)
    assert entry["cases"] == EVERY_CASE and entry["baseline"] == {"commit": "0ld0000", "cases": EVERY_CASE}
    assert (entry["calls"], entry["date"], entry["reason"]) == (3, "2026-12-04", "exact losses")


def test_repeated_runs_are_judged_by_their_median_speed_and_largest_memory():
    runs = [{"tokens_per_second": tps, "step_seconds": 13384 / tps, "peak_allocated_gib": 12.9 + i / 100,
             "peak_reserved_gib": 13.3 + i / 100, "step0_loss": 12.98, "frames": 128}
            for i, tps in enumerate([12829.0, 11906.0, 12400.0])]
    figures = perf_guard.repeated(runs)
    assert figures["tokens_per_second"] == 12400.0 and figures["step_seconds"] == 13384 / 12400.0
    assert (figures["peak_allocated_gib"], figures["peak_reserved_gib"]) == (12.92, 13.32)
    assert figures["tokens_per_second_runs"] == [12829.0, 11906.0, 12400.0] and figures["frames"] == 128
    assert "tokens_per_second_runs" not in perf_guard.repeated(runs[:1])
    # the list of runs is kept, not compared: a 4% slower median fails on its own
    slower = {**figures, "tokens_per_second": 0.96 * 12400.0, "tokens_per_second_runs": [1.0]}
    rows = perf_guard.compare({"fixed128": figures}, {"fixed128": slower})
    assert failing(rows) == [("fixed128", "tokens_per_second")]
    assert "tokens_per_second_runs" not in {row["figure"] for row in rows}


def test_repeats_alternate_the_tree_run_first_and_keep_each_run_apart(tmp_path, monkeypatch):
    """The order a drifting machine needs: baseline, this, then this, baseline (what the second run of a pair
    finds falls on both trees); each run in its own folder."""
    calls = []

    def run_case(case, tree, out, work):
        calls.append((tree.name, out.relative_to(tmp_path).as_posix()))
        speed = 100.0 + len(calls)
        return {"tokens_per_second": speed, "step_seconds": 1 / speed, "peak_allocated_gib": 1.0,
                "peak_reserved_gib": 1.0, "step0_loss": 2.0}

    monkeypatch.setattr(perf_guard, "run_case", run_case)
    monkeypatch.setattr(perf_guard, "ROOT", tmp_path / "this_tree")
    runs = perf_guard.run_pairs(["fixed128"], tmp_path / "base_tree", tmp_path / "out", tmp_path / "work", repeats=2)
    old, new = perf_guard.figures_over_runs(runs)
    assert calls == [("base_tree", "out/baseline/repeat0"), ("this_tree", "out/this/repeat0"),
                     ("this_tree", "out/this/repeat1"), ("base_tree", "out/baseline/repeat1")]
    assert old["fixed128"]["tokens_per_second_runs"] == [101.0, 104.0] and old["fixed128"]["tokens_per_second"] == 102.5
    assert new["fixed128"]["tokens_per_second_runs"] == [102.0, 103.0]


def test_over_repeats_the_change_is_the_median_of_each_pair_s_ratio():
    """A machine drifting between repeats (100, 110, 120 tokens/s for the baseline) hides a 5% drop in two
    pairs of three from the medians (110 -> 114); the pairs show it."""
    def case(runs):
        return {"fixed128": {"tokens_per_second": sorted(runs)[1], "peak_reserved_gib": 10.0,
                             "tokens_per_second_runs": runs}}

    before, after = case([100.0, 110.0, 120.0]), case([95.0, 132.0, 114.0])
    (speed,) = [row for row in perf_guard.compare(before, after) if row["figure"] == "tokens_per_second"]
    assert (round(speed["change"], 4), speed["fails"]) == (-0.05, True)
    assert round(speed["spread"], 4) == round(132 / 95 - 1, 4)  # the wider of the two trees' spreads
    # one run each (or a ledger entry without every run): the figures' ratio, no spread
    (single,) = [row for row in perf_guard.compare({"fixed128": {"tokens_per_second": 100.0}},
                                                   {"fixed128": {"tokens_per_second": 96.0}})]
    assert (round(single["change"], 4), single["spread"], single["fails"]) == (-0.04, None, True)


def test_a_failing_case_whose_runs_lie_further_apart_than_the_bar_asks_for_more_repeats():
    def rows(old_runs, new_runs):
        return perf_guard.compare(
            {"plan12": {"tokens_per_second": statistics.median(old_runs), "tokens_per_second_runs": old_runs}},
            {"plan12": {"tokens_per_second": statistics.median(new_runs), "tokens_per_second_runs": new_runs}})

    # plan12 on one H200 (bench/RESULTS.md): the pairs 0.894 and 0.969, the new tree's runs 27% apart
    noisy = rows([10274.5, 12059.0], [9185.4, 11691.4])
    ok, why = perf_guard.verdict(noisy, None)
    assert not ok and "plan12 tokens_per_second -6.8%" in why and "plan12's runs lie 27.3% apart" in why
    assert "FAILS; runs 27.3% apart; pairs 0.894-0.970" in perf_guard.table(noisy)
    ok, why = perf_guard.verdict(rows([10000.0, 10100.0], [9500.0, 9600.0]), None)  # 1% apart: a drop
    assert not ok and "apart" not in why and "--repeats" not in why
    assert perf_guard.verdict(rows([10000.0, 10100.0], [9900.0, 10050.0]), None)[0]


def test_each_run_keeps_its_step_seconds_beside_the_medians():
    runs = [{"tokens_per_second": tps, "step_seconds": 1.0, "peak_allocated_gib": 1.0, "peak_reserved_gib": 1.0,
             "step0_loss": 2.0, "step_seconds_each": each}
            for tps, each in [(100.0, [3.0, 1.0, 1.1]), (90.0, [3.1, 1.3, 1.0])]]
    figures = perf_guard.repeated(runs)
    assert figures["step_seconds_runs"] == [[3.0, 1.0, 1.1], [3.1, 1.3, 1.0]] and "step_seconds_each" not in figures
    runs[0]["allocator_retries_each"], runs[1]["allocator_retries_each"] = [0, 2, 0], [0, 0, 0]
    runs[0]["mfu"], runs[1]["mfu"] = 0.30, 0.27  # with the speeds' median, not the first run's
    assert round(perf_guard.repeated(runs)["mfu"], 6) == 0.285
    assert perf_guard.repeated(runs)["allocator_retries_runs"] == [[0, 2, 0], [0, 0, 0]]
    assert "step_seconds_runs" not in {row["figure"] for row in perf_guard.compare({"c": figures}, {"c": figures})}


def test_both_trees_pack_with_the_train_stage_s_allocator_unless_the_user_set_one(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    env = perf_guard.packing_environment(tmp_path)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "src")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert perf_guard.packing_environment(tmp_path)["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_both_trees_time_the_second_pass_only_when_both_can(tmp_path):
    """A baseline from before --passes times its one pass after a warm-up: this tree then times the same."""
    trees = {}
    for name, text in (("old", 'parser.add_argument("--warmup", type=int, default=2)'),
                       ("new", 'parser.add_argument("--passes", type=int, default=2)')):
        (tmp_path / name / "bench").mkdir(parents=True)
        (tmp_path / name / "bench" / "packing.py").write_text(text)
        trees[name] = tmp_path / name
    assert perf_guard.packing_passes([trees["new"], trees["new"]]) == 2
    assert perf_guard.packing_passes([trees["new"], trees["old"]]) == 1
    assert perf_guard.packing_passes([perf_guard.ROOT]) == 2  # this tree's own bench/packing.py


def test_a_train_stage_case_reads_every_step_s_seconds_from_the_stage_s_step_log(tmp_path):
    """Where bench/train_throughput.py (this tree's and the baseline's alike) has the stage write its steps;
    the allocator's retries where the tree logs them in every step; the first sample's tokens and patches."""
    for folder, frames, cap, retries in (("ours-128-0", 128, None, None), ("ours-72-12", 72, 12.0, [0, 3])):
        log = tmp_path / folder / "steps.rank0.jsonl"
        log.parent.mkdir()
        steps = [{"step": i, "step_seconds": s, "grid": [[frames // 2, 28, 28]], "input_tokens": [13384],
                  "since_start_s": 41.2 + 2.84512 + i * 1.0313} for i, s in enumerate([2.84512, 1.0313])]
        for step, count in zip(steps, retries or []):
            step["allocator_retries"] = count
        log.write_text("".join(json.dumps(step) + "\n" for step in steps))
        logged = perf_guard.logged_steps(tmp_path, frames, cap)
        assert logged == {"sample": (13384, frames // 2 * 28 * 28), "step_seconds_each": [2.8451, 1.0313],
                          "start_seconds_each": 41.2,  # the stage's start to its first step
                          **({"allocator_retries_each": retries} if retries else {})}


def test_the_train_stage_cases_mfu_is_bench_flops_for_both_trees():
    """Qwen3.5-4B at 128 frames (13,384 tokens, 50,176 patches) at 12,977 tokens/s: bench/train_throughput.py's
    28.9% (bench/RESULTS.md); none on a GPU model whose peak bench/flops.py does not know."""
    assert round(perf_guard.mfu(12977.0, 13384, 50176, 989e12), 3) == 0.289
    assert perf_guard.mfu(12977.0, 13384, 50176, None) is None


def fake_cases(monkeypatch, tmp_path, seconds_per_run: float = 0.0) -> list:
    """Cases that cost ``seconds_per_run`` on a clock of their own, and this machine as an H200 with a ledger
    whose last entry (fb8f7c1) is the baseline: the guard's own logic around runs a test cannot make."""
    clock, calls = [0.0], []

    def run_case(case, tree, out, work, **_):
        calls.append(tree.name)
        clock[0] += seconds_per_run
        speed = 100.0 + len(calls)
        return {"tokens_per_second": speed, "step_seconds": 1 / speed, "peak_allocated_gib": 1.0,
                "peak_reserved_gib": 1.0, "step0_loss": 2.0}

    ledger = tmp_path / "this_tree" / "bench" / "perf_ledger.jsonl"
    ledger.parent.mkdir(parents=True)
    ledger.write_text(json.dumps(guard_run(EVERY_CASE, commit="fb8f7c1")["entry"]) + "\n")
    machine = {key: guard_run({})["entry"][key] for key in ("gpu", "driver", "packages")}
    monkeypatch.setattr(perf_guard, "LEDGER", ledger)
    monkeypatch.setattr(perf_guard, "ROOT", tmp_path / "this_tree")
    monkeypatch.setattr(perf_guard, "run_case", run_case)
    monkeypatch.setattr(perf_guard, "machine", lambda: machine)
    monkeypatch.setattr(perf_guard, "clock", lambda: clock[0])
    return calls


def test_a_time_limit_starts_no_pair_that_would_end_past_it_and_judges_the_pairs_run(tmp_path, monkeypatch, capsys):
    """A call's limit (600 s on the GPU machine) once stopped a guard of four plan12 pairs in its fourth: it
    printed three pairs and wrote nothing. Pairs of 200 s under a 500 s limit: two run, the third is not started."""
    calls = fake_cases(monkeypatch, tmp_path, seconds_per_run=100.0)
    out = tmp_path / "out"
    assert perf_guard.main(["--baseline", str(tmp_path / "base_tree"), "--cases", "plan12", "--repeats", "4",
                            "--time-limit", "500", "--commit", "2f74d0d", "--out", str(out)]) == 0
    assert calls == ["base_tree", "this_tree", "this_tree", "base_tree"]
    assert "time limit: plan12 ran 2 of 4 pairs in this call" in capsys.readouterr().out
    run = json.loads((out / "perf_guard.json").read_text())
    assert run["entry"]["cases"]["plan12"]["tokens_per_second_runs"] == [102.0, 103.0]
    assert len(run["runs"]["plan12"]["baseline"]) == 2 and run["ok"]


def test_a_run_stopped_from_outside_keeps_its_whole_pairs(tmp_path, monkeypatch):
    calls = fake_cases(monkeypatch, tmp_path)
    original = perf_guard.run_case

    def stopped_in_the_third_pair(*args, **kwargs):
        if len(calls) == 4:
            raise KeyboardInterrupt  # what timeout's signal does to the guard
        return original(*args, **kwargs)

    monkeypatch.setattr(perf_guard, "run_case", stopped_in_the_third_pair)
    out = tmp_path / "out"
    try:
        perf_guard.main(["--baseline", str(tmp_path / "base_tree"), "--cases", "plan12", "--repeats", "4",
                         "--commit", "2f74d0d", "--out", str(out)])
    except KeyboardInterrupt:
        pass
    run = json.loads((out / "perf_guard.json").read_text())
    assert run["entry"]["cases"]["plan12"]["tokens_per_second_runs"] == [102.0, 103.0]
    assert {name: len(each) for name, each in run["runs"]["plan12"].items()} == {"baseline": 2, "this": 2}


def test_more_continues_an_earlier_call_s_pairs_and_judges_them_together(tmp_path, monkeypatch, capsys):
    calls = fake_cases(monkeypatch, tmp_path)
    base = ["--baseline", str(tmp_path / "base_tree"), "--cases", "plan12", "--commit", "2f74d0d"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert perf_guard.main([*base, "--repeats", "2", "--out", str(first)]) == 0
    assert perf_guard.main([*base, "--more", str(first / "perf_guard.json"), "--out", str(second)]) == 0
    # the alternation goes on: the third pair runs the baseline first
    assert calls == ["base_tree", "this_tree", "this_tree", "base_tree", "base_tree", "this_tree"]
    run = json.loads((second / "perf_guard.json").read_text())
    assert run["entry"]["cases"]["plan12"]["tokens_per_second_runs"] == [102.0, 103.0, 106.0]
    assert run["entry"]["calls"] == 2 and "run beside it in each of 2 calls" in capsys.readouterr().out
    # another commit, or a file without runs, is refused with the file's name
    assert perf_guard.main([*base[:-1], "abc1234", "--more", str(second / "perf_guard.json"), "--out",
                            str(tmp_path / "third")]) == 1
    assert "second/perf_guard.json: its commit (2f74d0d) is not this call's (abc1234)" in capsys.readouterr().err
    old = write(tmp_path / "old.json", guard_run(EVERY_CASE))
    assert perf_guard.main([*base, "--more", str(old), "--out", str(tmp_path / "third")]) == 1
    assert "old.json: holds no runs to continue" in capsys.readouterr().err
    assert len(calls) == 6
    # appended with a call that ran the other cases: one entry of three calls
    others = {case: EVERY_CASE[case] for case in ("fixed128", "packed")}
    rest = write(tmp_path / "rest.json", guard_run(others, commit="2f74d0d",
                                                   baseline={"commit": "fb8f7c1", "cases": others}))
    assert perf_guard.main(["--append", str(rest), str(second / "perf_guard.json")]) == 0
    entry = perf_guard.read_ledger()[-1]
    assert entry["calls"] == 3 and entry["cases"]["plan12"]["tokens_per_second_runs"] == [102.0, 103.0, 106.0]


def test_without_a_gpu_the_guard_says_where_to_run_it(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="the cases run on a CUDA GPU and this machine has none"):
        perf_guard.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_each_run_keeps_what_its_host_did_besides_it_and_the_table_shows_the_range(tmp_path, monkeypatch):
    """A host-bound case moves with its host: each run keeps the share of CPU time other guests took and the
    share of its time a runnable task waited for a CPU, read from this machine's own counters."""
    before, after = perf_guard.host_sample(), None
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # some CPU time between the two samples
        pass
    after = perf_guard.host_sample()
    assert after["ticks"] > before["ticks"] and after["steal"] >= before["steal"]
    load = perf_guard.host_load(before, after)
    assert 0.0 <= load["host_steal_share_each"] <= 1.0
    assert load["cpu_waiting_share_each"] is None or load["cpu_waiting_share_each"] >= 0.0
    # 50 of 1,000 ticks stolen; 0.5 s of a 2 s run waiting for a CPU; a kernel without pressure accounting
    sample = {"at": 10.0, "ticks": 1000, "steal": 10, "waited_us": 1_000_000}
    assert perf_guard.host_load(sample, {"at": 12.0, "ticks": 2000, "steal": 60, "waited_us": 1_500_000}) == \
        {"host_steal_share_each": 0.05, "cpu_waiting_share_each": 0.25}
    assert perf_guard.host_load({**sample, "waited_us": None}, {"at": 12.0, "ticks": 2000, "steal": 10,
                                                                "waited_us": None})["cpu_waiting_share_each"] is None

    loads = iter([{"host_steal_share_each": 0.0, "cpu_waiting_share_each": 0.02},
                  {"host_steal_share_each": 0.04, "cpu_waiting_share_each": 0.31}] * 2)
    monkeypatch.setattr(perf_guard, "host_load", lambda before, after: next(loads))
    monkeypatch.setattr(perf_guard, "run_case", lambda case, tree, out, work: {
        "tokens_per_second": 100.0, "step_seconds": 1.0, "peak_allocated_gib": 1.0, "peak_reserved_gib": 1.0,
        "step0_loss": 2.0})
    runs = perf_guard.run_pairs(["plan12"], tmp_path / "base", tmp_path / "out", tmp_path / "work", repeats=2)
    old, new = perf_guard.figures_over_runs(runs)
    assert old["plan12"]["host_steal_share_runs"] == [0.0, 0.04]  # baseline first, then this tree first
    assert new["plan12"]["cpu_waiting_share_runs"] == [0.31, 0.02]
    (speed,) = [row for row in perf_guard.compare(old, new) if row["figure"] == "tokens_per_second"]
    assert speed["host"] == {"host_steal_share": (0.0, 0.04), "cpu_waiting_share": (0.02, 0.31)}
    assert "host CPU stolen 0.0%-4.0%; waiting for a CPU 2.0%-31.0%" in perf_guard.table([speed])

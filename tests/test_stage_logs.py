"""What the terminal shows of a stage's log (videosft.stage_logs): which jobs finished, and what a
finished stage wrote for the user."""

from __future__ import annotations

from videosft.stage_logs import finished_logs, stage_summary

# Snakemake 9's log of a run, as its lines stand (the jobs announce themselves with the rules' message:)
SNAKEMAKE_LOG = """\
[Sat Dec  5 02:06:39 2026]
Job 4: preprocess, shard 0: frames under the token budget, chat, labels (log: logs/preprocess/shard-0.log)
Reason: Missing output files: results/preprocess/shards/0
[Sat Dec  5 02:06:39 2026]
Job 7: preprocess, shard 1: frames under the token budget, chat, labels (log: logs/preprocess/shard-1.log)
Reason: Missing output files: results/preprocess/shards/1
[Sat Dec  5 02:06:43 2026]
Finished jobid: 7 (Rule: preprocess_shard)
3 of 10 steps (30%) done
[Sat Dec  5 02:06:43 2026]
Job 3: preprocess: the shards joined into one manifest (log: logs/preprocess/preprocess.log)
[Sat Dec  5 02:06:44 2026]
Error in rule preprocess:
    message: preprocess: the shards joined into one manifest (log: logs/preprocess/preprocess.log)
    log: logs/preprocess/preprocess.log (check log file(s) for error details)
"""


def test_the_finished_jobs_are_those_snakemake_saw_end_in_the_order_they_ended():
    # shard 0 never ended (the run stopped first), the gather failed: only shard 1 finished
    assert finished_logs(SNAKEMAKE_LOG) == ["logs/preprocess/shard-1.log"]
    assert finished_logs(SNAKEMAKE_LOG + "Finished jobid: 4 (Rule: preprocess_shard)\n") == [
        "logs/preprocess/shard-1.log", "logs/preprocess/shard-0.log"]


# the same under --verbose: each job's details instead of its rule's message
VERBOSE_LOG = """\
[Sat Dec  5 02:03:02 2026]
localrule demo:
    input: /tmp/demo/src/videosft/config.py, /tmp/demo/src/videosft/errors.py
    output: data/demo/videos, data/demo/annotations.jsonl, data/demo/model
    log: logs/demo/demo.log
    jobid: 6
    benchmark: benchmarks/demo/demo.tsv
    resources: tmpdir=/tmp
[Sat Dec  5 02:03:08 2026]
Finished jobid: 6 (Rule: demo)
[Sat Dec  5 02:03:34 2026]
localrule all:
    input: results/verify/verify.json, results/report/run_record.json
    jobid: 0
[Sat Dec  5 02:03:34 2026]
Finished jobid: 0 (Rule: all)
"""


def test_the_finished_jobs_are_read_from_their_details_under_verbose_too():
    assert finished_logs(VERBOSE_LOG) == ["logs/demo/demo.log"]  # rule all has no log


def test_a_finished_stage_shows_its_warnings_once_and_its_last_own_line():
    log = "\n".join([
        "[transformers] `causal_conv1d_fn` is falling back to its reference PyTorch implementation",
        "WARNING: flash-linear-attention does not import here; install it",  # rank 0
        "WARNING: flash-linear-attention does not import here; install it",  # rank 1
        "train: 1/4 steps (25%); step 0: loss 5.9217",
        "[2026-12-05 02:03:07,688] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "train: 4/4 steps (100%), 6.25 steps/s; step 3: loss 5.9393",
        "E1203 11:55:21.453000 10433 api.py:1002] train: torchrun's line, not the stage's",
    ])
    assert stage_summary(log, "train") == ["WARNING: flash-linear-attention does not import here; install it",
                                           "train: 4/4 steps (100%), 6.25 steps/s; step 3: loss 5.9393"]
    # a preprocess shard's log: its warnings only (the joined manifest's line says what the stage made)
    assert stage_summary("preprocess shard 0/2: 6 samples\nWARNING: 2 windows rejected", "preprocess",
                         main_log=False) == ["WARNING: 2 windows rejected"]
    assert stage_summary("Loading weights: 100%\n", "verify") == []

"""The pipeline submitted to a real Slurm cluster through workflow/profiles/slurm, and the
multi-node torchrun launcher workflow/scripts/torchrun-slurm.sh.

The cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd from Debian's packages; see
slurm_cluster.py) is started once for this module and always stopped at its end. Without the
packages the cluster tests are skipped, saying how to install them (`bash .ci/install-slurm.sh` as
root; the tests themselves never install anything); the launcher's own tests need no Slurm at all.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurm_cluster  # noqa: E402
from conftest import copy_checkout  # noqa: E402
from processes import run_bounded  # noqa: E402

PROJECT = Path(__file__).resolve().parents[2]
LAUNCHER = PROJECT / "workflow" / "scripts" / "torchrun-slurm.sh"
PROFILE = PROJECT / "workflow" / "profiles" / "slurm" / "config.yaml"
# Each stage's run record; the records copy the SLURM_* environment of the process that wrote them.
RECORDS = {
    "demo": ["data/demo"],
    "window": ["results/window"],
    "preprocess_shard": ["results/preprocess/shards/0", "results/preprocess/shards/1"],
    "probe": ["results/probe"],
    "train": ["results/train"],
    "verify": ["results/verify"],
}
# Seconds of work each (joining the shards' manifests; figures): they run beside Snakemake (localrule).
LOCAL = ["results/preprocess", "results/report"]
PIPELINE_TIMEOUT = 900

# A tiny torch.distributed program: every rank adds rank + 1 with a gloo all-reduce.
ALLREDUCE = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
result = {"rank": rank, "world": world, "sum": value.item(), "group_rank": int(os.environ["GROUP_RANK"]),
          "local_rank": int(os.environ["LOCAL_RANK"]), "slurm_nodeid": os.environ.get("SLURM_NODEID")}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
dist.destroy_process_group()
"""


def read_results(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))]


def free_port() -> int:
    return slurm_cluster.free_port()


# --- the launcher, without Slurm -----------------------------------------------------------------

@pytest.fixture
def fake_python(tmp_path) -> tuple[Path, Path]:
    """A PATH with bash and hostname but no scontrol, and a PYTHON that prints its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "hostname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    python = bin_dir / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    return bin_dir, python


def launch_args(fake_python, slurm_env: dict, *args: str) -> subprocess.CompletedProcess:
    bin_dir, python = fake_python
    env = {"PATH": str(bin_dir), "PYTHON": str(python), **slurm_env}
    return subprocess.run([str(LAUNCHER), *args], env=env, capture_output=True, text=True, timeout=30)


def test_launcher_builds_the_rendezvous_from_slurm_variables(fake_python):
    # As srun sets them in the third node's task of a 4-node job; no scontrol on the PATH, so the
    # head node comes from the documented fallback expansion of the bracketed node list.
    result = launch_args(fake_python, {"SLURM_JOB_ID": "123456", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
                                       "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_NODEID": "2"},
                         "2", "-m", "videosft.stages.train", "--config", "{}", "--out", "results/train")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == [
        "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu07:32956", "--rdzv-id", "123456", "--rdzv-conf", "is_host=0",
        "-m", "videosft.stages.train", "--config", "{}", "--out", "results/train"]

    # The step's node count and node list come first; MASTER_PORT overrides the derived port;
    # node 0 hosts the store.
    result = launch_args(fake_python, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "2",
                                       "SLURM_JOB_NODELIST": "a[1-3]", "SLURM_STEP_NODELIST": "a[2-3]",
                                       "SLURM_NODEID": "0", "MASTER_PORT": "40001"}, "1", "prog.py")
    assert result.returncode == 0, result.stderr
    args = result.stdout.split()
    assert args[args.index("--nnodes") + 1] == "2"
    assert args[args.index("--rdzv-endpoint") + 1] == "a2:40001"
    assert args[args.index("--rdzv-conf") + 1] == "is_host=1"


@pytest.mark.parametrize("env, nproc, message", [
    ({}, "2", "SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, "2", "SLURM_NODEID is not set"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "2"}, "2",
     "not in 0..1"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"}, "0", "positive integer"),
])
def test_launcher_refuses_an_incomplete_allocation(fake_python, env, nproc, message):
    result = launch_args(fake_python, env, nproc, "-m", "videosft.stages.train")
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.slow  # two torchrun agents and their ranks
def test_two_torchrun_agents_meet_through_the_launcher(tmp_path):
    """Two 'nodes' on this machine: one agent each, as `srun --ntasks-per-node=1` would start them
    (only the environment is Slurm's; the rendezvous, the agents and the all-reduce are real)."""
    program = tmp_path / "allreduce.py"
    program.write_text(ALLREDUCE)
    out = tmp_path / "out"
    out.mkdir()
    host = "localhost"
    common = {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
              "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
              "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": host,
              "SLURM_NODELIST": host, "SLURM_STEP_NODELIST": host, "SLURM_LOCALID": "0"}
    agents = [subprocess.Popen([str(LAUNCHER), "1", str(program), str(out)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**common, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)})
              for node in (1, 0)]  # the non-host agent first: it must wait for the store, not fail
    outputs = []
    deadline = time.monotonic() + 180
    try:
        for agent in agents:
            output, _ = agent.communicate(timeout=max(1, deadline - time.monotonic()))
            outputs.append(output)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    results = read_results(out)
    assert [r["rank"] for r in results] == [0, 1], "\n".join(outputs)
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["local_rank"] == 0 for r in results), results
    assert sorted(r["group_rank"] for r in results) == [0, 1]
    assert sorted(r["slurm_nodeid"] for r in results) == ["0", "1"]


# --- a real cluster ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.not_installed()
    if reason:
        pytest.skip(reason)
    reason = slurm_cluster.conf_in_the_way()
    if reason:
        pytest.skip(reason)
    instance = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()


def wait_for_jobs(cluster, job_ids, timeout: float = 60) -> dict[str, dict]:
    """sacct's row per job once every job has one in a final state."""
    deadline = time.monotonic() + timeout
    while True:
        rows = {row["JobID"]: row for row in cluster.sacct(job_ids, "JobID,State,ExitCode,Comment,Partition,Account")}
        if set(rows) == set(map(str, job_ids)) and not any(r["State"] in ("PENDING", "RUNNING") for r in rows.values()):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct after {timeout} s: {rows}\n{cluster.logs()}")
        time.sleep(1)


@pytest.mark.slow  # a Slurm cluster
def test_launcher_inside_a_real_allocation(cluster, tmp_path):
    """srun starts the launcher in a real job: Slurm's own variables, scontrol for the head node."""
    program = tmp_path / "allreduce.py"
    program.write_text(ALLREDUCE)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    result = run_bounded(["sbatch", "--parsable", "-p", cluster.partition, "-A", cluster.account, "--nodes=1",
                          "--ntasks-per-node=1", f"--cpus-per-task={cluster.cpus}", "--mem=2000", "-t", "5",
                          f"--output={tmp_path / 'job.log'}", "--wrap",
                          f"srun --ntasks-per-node=1 {LAUNCHER} 2 {program} {out}"],
                         timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    job_id = result.stdout.strip().split(";")[0]
    rows = wait_for_jobs(cluster, [job_id], timeout=180)
    log = (tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""
    assert rows[job_id]["State"] == "COMPLETED", log
    assert f"node 0 of 1 on {cluster.host}, 2 processes, rendezvous {job_id} at {cluster.host}:" in log, log
    results = read_results(out)
    assert [(r["rank"], r["world"], r["sum"], r["group_rank"]) for r in results] == [(0, 2, 3.0, 0), (1, 2, 3.0, 0)]


def test_profile_is_complete():
    """The shipped profile: slurm executor, placeholders to replace, CPU-only data stages, GPUs for train;
    nothing for the rules that run beside Snakemake."""
    profile = yaml.safe_load(PROFILE.read_text())
    assert profile["executor"] == "slurm" and profile["jobs"] > 0 and profile["latency-wait"] > 0
    assert "CHANGE-ME" in profile["default-resources"]["slurm_partition"]
    assert "CHANGE-ME" in profile["default-resources"]["slurm_account"]
    resources = profile["set-resources"]
    for rule in ("demo", "window", "preprocess_shard", "probe", "verify"):
        assert {"cpus_per_task", "mem_mb", "runtime"} <= set(resources[rule]), rule
        assert "gpu" not in resources[rule] and "gres" not in resources[rule], rule
    train = resources["train"]
    assert train["nproc"] == train["gpu"] and train["tasks_per_gpu"] == 0
    assert {"cpus_per_gpu", "mem_mb", "runtime"} <= set(train)
    assert profile["set-threads"]["train"] == train["gpu"] * train["cpus_per_gpu"]
    assert not {"preprocess", "report"} & set(resources)


@pytest.mark.slow  # a dry run of the whole workflow: 1.5 s on idle cores, 5.5 s beside other tests
def test_profile_keys_are_options_snakemake_knows(tmp_path):
    workdir = copy_checkout(tmp_path)
    # --verbose: each job's resources (without it each job is its rule's one-line message)
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--verbose", "--workflow-profile",
                             "workflow/profiles/slurm"],
                            cwd=workdir, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "PYTHONPATH": str(workdir / "src")})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "slurm_partition=CHANGE-ME-partition" in output and "gpu=2" in output, output


def cluster_profile(cluster, workdir: Path) -> Path:
    """The shipped profile with this cluster's partition and account, no GPUs, and what fits one node."""
    profile = yaml.safe_load(PROFILE.read_text())
    profile["default-resources"].update(slurm_partition=cluster.partition, slurm_account=cluster.account)
    memory, cpus = cluster.memory_mb // 4, max(1, cluster.cpus // 2)
    for rule, resources in profile["set-resources"].items():
        resources["mem_mb"] = min(resources["mem_mb"], memory)
        if "cpus_per_task" in resources:
            resources["cpus_per_task"] = min(resources["cpus_per_task"], cpus)
    profile["set-resources"]["train"]["gpu"] = 0  # no GPU here: the train job gets --cpus-per-task=threads
    profile["set-threads"]["train"] = min(profile["set-threads"]["train"], cluster.cpus)
    target = workdir / "workflow" / "profiles" / "slurm-test" / "config.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(profile, sort_keys=False))
    return target.parent


def snakemake_on_slurm(cluster, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """Most of the pipeline's time on Slurm is the executor's polling, which no option shortens
    much: snakemake-executor-plugin-slurm 2.8.0 sets the next wait itself after every sacct check,
    to --slurm-init-seconds-before-status-checks once a job has ended, and 10 s longer (hard-coded,
    up to 180 s) after a check that found none ended. So a job is seen 2, 14, 36 or 68 s after the
    one before it: a 12 s job at 14 s, a 15 s one at 36 s (on two idle cores the pipeline took 117 s,
    beside other tests 320 s). --seconds-between-status-checks is not read once the plugin has set
    its own wait, and --max-status-checks-per-second only spaces the sacct calls within one check.
    Another start value (at least 1) only moves the checks against the jobs' lengths, which follow
    the machine's load: for the lengths measured here, no start value waits less at every load."""
    profile = cluster_profile(cluster, workdir)
    env = {**os.environ, "PYTHONPATH": str(workdir / "src"), "OMP_NUM_THREADS": "1"}
    return run_bounded([sys.executable, "-m", "snakemake", "--workflow-profile", str(profile),
                        "--slurm-init-seconds-before-status-checks", "2", "--slurm-keep-successful-logs", *args],
                       timeout=PIPELINE_TIMEOUT, cwd=workdir, env=env)


def slurm_job_ids(output: str) -> dict[str, str]:
    """Slurm job id -> rule: the executor's "Job N has been submitted with SLURM jobid M", and job N's rule
    from Snakemake's "Finished jobid: N (Rule: X)", or for a failed job its "Error in rule X:" block
    ("jobid: N"; a job's header, "rule X:" ... "jobid: N", under --verbose)."""
    rule_of_job, submitted, current = {}, {}, None
    for line in output.splitlines():
        if match := re.match(r"\s*(?:localrule |rule |Error in rule )(\w+):", line):
            current = match.group(1)
        elif match := re.match(r"\s*jobid: (\d+)", line):
            rule_of_job[match.group(1)] = current
        elif match := re.search(r"Finished jobid: (\d+) \(Rule: (\w+)\)", line):
            rule_of_job[match.group(1)] = match.group(2)
        elif match := re.search(r"Job (\d+) has been submitted with SLURM jobid (\d+)", line):
            submitted[match.group(2)] = match.group(1)
    return {slurm_id: rule_of_job.get(job) for slurm_id, job in submitted.items()}


def failing_checkout(workdir: Path) -> list[str]:
    """A checkout whose annotations are one line that is not JSON (no rejects allowed): its window job
    fails at run time. The arguments that run it."""
    copy_checkout(workdir)
    bad = workdir / "bad"
    (bad / "videos").mkdir(parents=True)
    (bad / "annotations.jsonl").write_text("this line is not JSON\n")
    (bad / "config.yaml").write_text(yaml.safe_dump({"data": {
        "annotations": str(bad / "annotations.jsonl"), "root": str(bad / "videos"), "max_reject_fraction": 0}}))
    return ["results/window/windows.parquet", "--configfile", "bad/config.yaml"]


@pytest.fixture(scope="module")
def slurm_runs(cluster, tmp_path_factory) -> dict:
    """The whole pipeline on Slurm and, at the same time (both mostly wait on the executor's polling), a
    run whose window job fails: "pipeline" and "failing", each (its workdir, its Snakemake run)."""
    workdir = copy_checkout(tmp_path_factory.mktemp("slurm-checkout"))
    failing = tmp_path_factory.mktemp("slurm-failing")
    failing_args = failing_checkout(failing)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        failed = pool.submit(snakemake_on_slurm, cluster, failing, *failing_args)
        result = snakemake_on_slurm(cluster, workdir)
        failed_run = failed.result()
    logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}"
                     for p in sorted([*(workdir / "logs").rglob("*.log"), *(workdir / ".snakemake" / "slurm_logs").rglob("*.log")])
                     if p.is_file())
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{logs}\n{cluster.logs()}"
    print(f"pipeline on Slurm, and a failing run beside it: {time.monotonic() - started:.0f} s")
    return {"pipeline": (workdir, result), "failing": (failing, failed_run)}


@pytest.fixture(scope="module")
def slurm_run(slurm_runs) -> tuple[Path, str]:
    workdir, result = slurm_runs["pipeline"]
    return workdir, result.stdout


@pytest.mark.slow
def test_every_stage_ran_as_its_own_slurm_job(cluster, slurm_run):
    workdir, output = slurm_run
    submitted = slurm_job_ids(output)  # Slurm job id -> rule, as the executor reported the submissions
    records = {path.parent.relative_to(workdir).as_posix(): json.loads(path.read_text())
               for top in ("data", "results") for path in sorted((workdir / top).rglob("run_record.json"))}
    for rule, directories in RECORDS.items():
        for directory in directories:
            assert directory in records, f"{rule}: no {directory}/run_record.json"
    for directory in LOCAL:
        record = records.pop(directory)
        assert record["status"] == "ok" and not record["env"].get("SLURM_JOB_ID"), (directory, record["env"])
    job_of = {}
    for directory, record in records.items():
        assert record["status"] == "ok", (directory, record["status"])
        job_id = record["env"].get("SLURM_JOB_ID")
        assert job_id, f"{directory}/run_record.json: no SLURM_JOB_ID, the stage did not run under Slurm"
        job_of[directory] = job_id
    for rule, directories in RECORDS.items():
        for directory in directories:
            assert submitted.get(job_of[directory]) == rule, (directory, job_of[directory], submitted)
    # One job per stage and per shard, and every job the run submitted wrote a record.
    assert len(set(job_of.values())) == len(job_of) and set(job_of.values()) == set(submitted), (job_of, submitted)

    rows = wait_for_jobs(cluster, job_of.values())
    for directory, job_id in job_of.items():
        row = rows[job_id]
        assert row["State"] == "COMPLETED" and row["ExitCode"] == "0:0", (directory, row)
        assert row["Comment"].startswith(f"rule_{submitted[job_id]}"), (directory, row)
        assert row["Partition"] == cluster.partition and row["Account"] == cluster.account, row
    train = records["results/train"]["results"]
    assert train["world_size"] == 2
    assert json.loads((workdir / "results/verify/verify.json").read_text())["ok"]


@pytest.mark.slow
def test_a_job_that_fails_on_the_cluster_fails_the_run(cluster, slurm_runs):
    """A window job that fails at run time (a line that is not JSON, no rejects allowed)."""
    workdir, result = slurm_runs["failing"]
    output = result.stdout
    assert result.returncode != 0, output[-4000:]
    assert "Error in rule window" in output, output[-4000:]
    failed = re.findall(r"SLURM-job '(\d+)' failed", output)
    assert len(failed) == 1, output[-4000:]
    assert slurm_job_ids(output)[failed[0]] == "window"
    row = wait_for_jobs(cluster, failed)[failed[0]]
    assert row["State"] == "FAILED" and row["ExitCode"] != "0:0", row
    assert row["Comment"].startswith("rule_window"), row
    log = (workdir / "logs/window/window.log").read_text()
    assert "this line is not JSON" in log or "rejected" in log, log

import functools
import json
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

SRC = Path(workflow.basedir) / "src"
sys.path.insert(0, str(SRC))
from videosft.config import missing_path, resolve, stage_config
from videosft.errors import ConfigError
from videosft.stage_logs import failed_jobs, finished_logs, stage_message, stage_summary
from videosft.provenance import path_fingerprint, stage_sources

# The schema (workflow/schemas/config.schema.yaml) validates the config and fills its defaults, with one
# line per problem (the key, its value, what is allowed, the nearest key for a typo) instead of
# jsonschema's dump of the whole section; VIDEOSFT_DEBUG=1 adds the dump.
try:
    config.update(resolve(config))
except ConfigError as error:
    raise WorkflowError(str(error)) from None


wildcard_constraints:
    shard=r"\d+",

ENV = "../envs/videosft.yaml"


def sources(stage):
    """The stage's module and every videosft module it imports: a change to any reruns it.

    Stages get these paths as ``--code`` and refuse to run if the videosft they imported is
    another copy (a stale install), so what ran is what Snakemake tracked.
    """
    return [str(path) for path in stage_sources(stage)]


VERBOSE = bool(getattr(getattr(workflow, "output_settings", None), "verbose", False))


def announce(text):
    """A rule's message: its job as one line on the terminal, what it does and where its log is
    (videosft.stage_logs reads the log's name there). None under --verbose, where Snakemake shows
    the job's inputs, outputs and resources instead (a message would replace them)."""
    return None if VERBOSE else f"{text} (log: {{log}})"


def stage_json(stage):
    """The config sections the stage reads, as JSON: a change to them reruns it (params trigger).

    A function, so that braces in config values are not taken for wildcards.
    """
    text = json.dumps(stage_config(stage, config), sort_keys=True)
    return lambda wildcards: text


def made_by_demo(path):
    """Whether ``path`` is exactly one of the demo rule's outputs, which Snakemake tracks itself (a path
    merely under data/demo/, such as a typo of one, is not)."""
    return os.path.normpath(path) in {os.path.normpath(output) for output in rules.demo.output}


def config_path(key):
    """The path at a dotted config key (``data.root``), which must exist unless the demo rule makes
    it: a missing input is an error before anything runs, never a run on earlier outputs."""
    section, name = key.split(".")
    path = config[section][name]
    if not Path(path).exists() and not made_by_demo(path):
        raise WorkflowError(missing_path(key, path))
    return path


@functools.cache
def _fingerprint(path):
    return "made by rule demo" if made_by_demo(path) else path_fingerprint(path)


def data_fingerprint(*keys):
    """Params that change when any file at these config paths changes (size or modification time
    of the file, or of every file under the directory): Snakemake sees a directory input change only
    when an entry is added or removed, not when a video or checkpoint file in it is replaced."""
    text = "; ".join(f"{key}={config_path(key)}: {_fingerprint(config_path(key))}" for key in keys)
    return lambda wildcards: text


def output_dir(wildcards, output):
    """The stage's output directory: where its run record lands."""
    return str(Path(output.record).parent)


TORCHRUN_SLURM = str(Path(workflow.basedir) / "workflow" / "scripts" / "torchrun-slurm.sh")


def train_launcher(wildcards, threads, resources):
    """torchrun on one node; with nodes > 1 one torchrun-slurm.sh agent per node, started by srun."""
    if resources.nodes > 1:
        return (f"srun --nodes={resources.nodes} --ntasks-per-node=1 --cpus-per-task={threads} "
                f"--kill-on-bad-exit=1 {TORCHRUN_SLURM} {resources.nproc}")
    return f"torchrun --standalone --nproc_per_node {resources.nproc}"


def predict_inputs(wildcards):
    """The adapter the predict stage applies (the train stage's, another, or none for a merged
    model.path) and the windows it reads (only for predict.videos: val)."""
    adapter = config["predict"]["adapter"]
    inputs = {}
    if adapter:
        inputs["adapter"] = rules.train.output.adapter if adapter == "results/train/adapter" else adapter
    if config["predict"]["videos"] == "val":
        inputs["windows"] = rules.window.output.windows
    return inputs


def new_videos():
    """predict.videos when it names new videos (a folder or a file): checked like every config path, so a
    typo stops the run before anything runs, training included; nothing for the val split."""
    return [] if config["predict"]["videos"] == "val" else config_path("predict.videos")


def predict_options(wildcards, input):
    return " ".join(f"--{name} {path}" for name, path in input.items() if name in ("adapter", "windows"))


def report_inputs(wildcards):
    """predict's summary when the report shows its source-time evaluation (report.source_time):
    a declared input, so that the default run then predicts and reruns the report after it."""
    return {"predict": rules.predict.output.summary} if config["report"]["source_time"] else {}


def report_options(wildcards, input):
    return f"--predict {input.predict}" if "predict" in input.keys() else ""


def snakemake_log_text(snakemake_logs) -> str:
    """Snakemake's log file(s) of this run, as one text."""
    paths = [snakemake_logs] if isinstance(snakemake_logs, (str, Path)) else list(snakemake_logs or [])
    return "".join(Path(path).read_text(errors="replace") for path in paths if Path(path).exists())


def show_finished_stages(snakemake_logs):
    """After Snakemake's lines, what each stage that finished in this run wrote for the user into its log:
    its warnings (each once) and its last line of its own, what it made. ``snakemake_logs``: Snakemake's
    log file(s)."""
    print_finished_stages(snakemake_log_text(snakemake_logs))


def print_finished_stages(text):
    shown = []
    for log in map(Path, finished_logs(text)):
        if log.exists():
            stage = log.parent.name
            shown += stage_summary(log.read_text(errors="replace"), stage, main_log=log.stem == stage)
    if shown:  # a warning several stages repeat (the probe's, then the train stage's and the report's) once
        print("\n=== what the stages said (their whole logs are under logs/):\n" + "\n".join(dict.fromkeys(shown)),
              file=sys.stderr)


def show_failed_stages(snakemake_logs):
    """After Snakemake's own account of a failure, what the stages that finished said for the user, then
    what each failed stage said last (its message and what to do, or a bug's traceback), read from its
    log: the lines the user needs, last on the terminal. ``snakemake_logs``: Snakemake's log file(s)."""
    text = snakemake_log_text(snakemake_logs)  # read once for both
    print_finished_stages(text)
    for rule, log in failed_jobs(text):
        if Path(log).exists():
            print(f"\n=== {rule} failed; the end of {log}:\n{stage_message(Path(log).read_text(errors='replace'))}",
                  file=sys.stderr)

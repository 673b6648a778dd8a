import json
import sys
from pathlib import Path

from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")


wildcard_constraints:
    shard=r"\d+",

SRC = Path(workflow.basedir) / "src"
sys.path.insert(0, str(SRC))
from videosft.config import stage_config
from videosft.provenance import stage_sources

ENV = "../envs/videosft.yaml"


def sources(stage):
    """The stage's module and every videosft module it imports: a change to any reruns it.

    Stages get these paths as ``--code`` and refuse to run if the videosft they imported is
    another copy (a stale install), so what ran is what Snakemake tracked.
    """
    return [str(path) for path in stage_sources(stage)]


def stage_json(stage):
    """The config sections the stage reads, as JSON: a change to them reruns it (params trigger).

    A function, so that braces in config values are not taken for wildcards.
    """
    text = json.dumps(stage_config(stage, config), sort_keys=True)
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

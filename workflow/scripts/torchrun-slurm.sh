#!/usr/bin/env bash
# torchrun-slurm.sh: one torchrun agent per node of a Slurm allocation, joined by a c10d rendezvous.
#
#   srun --ntasks-per-node=1 workflow/scripts/torchrun-slurm.sh NPROC -m videosft.stages.train ARGS...
#   srun --ntasks-per-node=1 workflow/scripts/torchrun-slurm.sh NPROC script.py ARGS...
#
# How the train rule uses it: with one node the rule runs `torchrun --standalone
# --nproc_per_node {resources.nproc} -m videosft.stages.train ...` as before; with resources.nodes > 1
# it runs, from the job's batch step,
#
#   srun --nodes={resources.nodes} --ntasks-per-node=1 workflow/scripts/torchrun-slurm.sh \
#       {resources.nproc} -m videosft.stages.train --config ... --out ...
#
# so that Slurm starts this script once on every node, each starting NPROC processes (one per
# GPU: NPROC = GPUs per node), and every agent meets the others at the head node.
#
# What is taken from Slurm's environment (srun sets all of these in each task):
#   nodes       SLURM_STEP_NUM_NODES, else SLURM_JOB_NUM_NODES, else SLURM_NNODES (the step's
#               count comes first: the agents that must meet are those of this srun step)
#   node rank   SLURM_NODEID (0 .. nodes-1, the node's index in the step's node list). Node 0
#               hosts the rendezvous store (--rdzv-conf is_host=...), so which agent serves it
#               never depends on hostname matching; torchrun itself assigns the ranks.
#   head node   the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, else
#               SLURM_NODELIST), expanded by `scontrol show hostnames LIST | head -n1`.
#               FALLBACK when scontrol is absent or fails (a container without Slurm's client
#               commands, or without a slurm.conf: scontrol needs one even to expand names):
#               a plain name ("gpu7") or a comma list ("gpu7,gpu9") gives its first name; a
#               bracketed range ("gpu[07-09,12]-ib") gives prefix + first number + suffix
#               ("gpu07-ib"). Names with two bracket groups ("r[1-2]n[1-4]") need scontrol;
#               TORCHRUN_SLURM_HEAD, when set, is the head host in any case.
#   port        MASTER_PORT if set, else 29500 + SLURM_JOB_ID % 10000 (a different port for
#               each job, so two jobs sharing a head node do not collide).
#   rdzv id     SLURM_JOB_ID.
# PYTHON (default: python) is the interpreter that runs torch.distributed.run (= torchrun).
set -euo pipefail

die() { echo "torchrun-slurm.sh: $*" >&2; exit 2; }

[[ $# -ge 2 ]] || die "usage: $0 NPROC_PER_NODE (-m MODULE | SCRIPT) [ARGS...]"
nproc=$1
shift
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, got '$nproc'"
[[ -n ${SLURM_JOB_ID:-} ]] || die "SLURM_JOB_ID is not set: run this inside a Slurm allocation, via srun"

nnodes=${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}
[[ -n $nnodes ]] || die "none of SLURM_STEP_NUM_NODES, SLURM_JOB_NUM_NODES, SLURM_NNODES is set"
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || die "node count must be a positive integer, got '$nnodes'"
node_rank=${SLURM_NODEID:-}
if [[ -z $node_rank ]]; then
    [[ $nnodes -eq 1 ]] || die "SLURM_NODEID is not set: start one task per node (srun --ntasks-per-node=1)"
    node_rank=0
fi
[[ $node_rank =~ ^[0-9]+$ && $node_rank -lt $nnodes ]] || die "SLURM_NODEID '$node_rank' is not in 0..$((nnodes - 1))"

first_host() {
    local list=$1
    local expanded=""
    if command -v scontrol >/dev/null 2>&1; then
        expanded=$(scontrol show hostnames "$list" 2>/dev/null | head -n1) || expanded=""
    fi
    if [[ -n $expanded ]]; then
        echo "$expanded"
        return
    fi
    # Fallback without a working scontrol: the first name of the list, see the header.
    local first=${list%%,*}
    if [[ $list == *"["* && ${list%%\[*} != *,* ]]; then
        local prefix=${list%%\[*} inside=${list#*\[}
        local suffix=${inside#*]}
        first=$prefix${inside%%[],-]*}${suffix%%,*}
    fi
    echo "$first"
}

head=${TORCHRUN_SLURM_HEAD:-}
if [[ -z $head ]]; then
    nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}}
    [[ -n $nodelist ]] || die "none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set"
    head=$(first_host "$nodelist")
fi
[[ -n $head ]] || die "could not find the head node"
port=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 10000))}
is_host=$([[ $node_rank -eq 0 ]] && echo 1 || echo 0)

echo "torchrun-slurm.sh: node $node_rank of $nnodes on $(hostname -s), $nproc processes," \
     "rendezvous ${SLURM_JOB_ID} at $head:$port" >&2
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$nnodes" \
    --nproc-per-node "$nproc" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$head:$port" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-conf "is_host=$is_host" \
    "$@"

#!/usr/bin/env bash
# Debian's Slurm (slurmctld, slurmd, slurmdbd, client commands), munge and MariaDB, for
# tests/workflow/test_slurm.py, which starts its own throwaway cluster from them (no service is
# started here: the packages' init scripts are not run in CI). Idempotent and quiet; a machine
# that is not root or has no apt-get is left alone, and the Slurm tests then skip with the reason.
set -euo pipefail
packages=(slurm-wlm slurmdbd munge mariadb-server)
commands=(slurmctld slurmd slurmdbd sbatch sacct sacctmgr munged mariadbd mariadb-install-db)
missing=0
for command in "${commands[@]}"; do
    PATH=$PATH:/usr/sbin:/sbin command -v "$command" >/dev/null 2>&1 || missing=1
done
if [[ $missing -eq 0 ]]; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm.sh: not root or no apt-get; not installing ${packages[*]}" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { timeout 600 apt-get update -qq && \
       timeout 900 apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; }; then
    # Not fatal here: test_slurm.py tries once more and otherwise skips, saying why.
    echo "install-slurm.sh: WARNING: could not install ${packages[*]}; the Slurm tests will skip" >&2
fi

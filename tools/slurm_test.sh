#!/usr/bin/env bash
# Evaluate a checkpoint on a Slurm cluster with srun and mmengine:
#   [GPUS=8] tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [tools/test.py arguments...]
# GPUS tasks in all (default 8), GPUS_PER_NODE of them on each node with as many GPUs (default: GPUS, at
# most 8), CPUS_PER_TASK CPUs each (5), PORT the master port (29500), SRUN_ARGS more srun options.
# Runs the checkout's .venv/bin/python (make setup; VENV=.venv312 another), else $PYTHON, else python on
# PATH, at the same path on every node; DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG CHECKPOINT [tools/test.py arguments...]" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
CHECKPOINT=$4
shift 4
launch_srun "$PARTITION" "$JOB_NAME" test.py "$CONFIG" "$CHECKPOINT" "$@"

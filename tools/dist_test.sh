#!/usr/bin/env bash
# Evaluate a checkpoint on several GPUs (or CPU processes) with torchrun and mmengine:
#   tools/dist_test.sh CONFIG CHECKPOINT NUM_PROCS_PER_NODE [tools/test.py arguments...]
# Several nodes: run it on every node with NNODES, NODE_RANK, MASTER_ADDR (and PORT, default 29500) set.
# Runs the checkout's .venv/bin/python (make setup; VENV=.venv312 another), else $PYTHON, else python on
# PATH; DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT NUM_PROCS_PER_NODE [tools/test.py arguments...]" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
CONFIG=$1
CHECKPOINT=$2
NPROC=$3
shift 3
launch_torchrun "$NPROC" test.py "$CONFIG" "$CHECKPOINT" "$@"

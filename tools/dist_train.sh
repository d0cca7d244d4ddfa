#!/usr/bin/env bash
# Train on several GPUs (or CPU processes) with torchrun and mmengine:
#   tools/dist_train.sh CONFIG NUM_PROCS_PER_NODE [tools/train.py arguments...]
# Several nodes: run it on every node with NNODES, NODE_RANK, MASTER_ADDR (and PORT, default 29500) set:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 tools/dist_train.sh configs/pervit_t_imagenet.py 8
# Runs the checkout's .venv/bin/python (make setup; VENV=.venv312 another), else $PYTHON, else python on
# PATH; DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG NUM_PROCS_PER_NODE [tools/train.py arguments...]" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
CONFIG=$1
NPROC=$2
shift 2
launch_torchrun "$NPROC" train.py "$CONFIG" "$@"

#!/usr/bin/env bash
# Train on several GPUs (or CPU processes) with torchrun and mmengine:
#   tools/dist_train.sh CONFIG NUM_PROCS_PER_NODE [tools/train.py arguments...]
# Several nodes: run it on every node with NNODES, NODE_RANK, MASTER_ADDR (and PORT) set, e.g.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 tools/dist_train.sh configs/pervit_t_imagenet.py 8
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG NUM_PROCS_PER_NODE [train.py arguments...]" >&2
    exit 2
fi
CONFIG=$1
NPROC=$2
shift 2
PYTHON=${PYTHON:-python}
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --master_port="${PORT:-29500}" \
    --nproc_per_node="$NPROC" \
    "$(dirname "$0")/train.py" "$CONFIG" --launcher pytorch "$@"

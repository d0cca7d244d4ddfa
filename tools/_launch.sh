# How tools/dist_train.sh, dist_test.sh, slurm_train.sh and slurm_test.sh start tools/train.py and
# tools/test.py; sourced by them, not run.
#
# launch_torchrun NUM_PROCS_PER_NODE TOOL ARGS...: torchrun (mmengine's `pytorch` launcher) on this
#   node, one of NNODES (default 1) with NODE_RANK (0), MASTER_ADDR (127.0.0.1) and PORT (29500).
# launch_srun PARTITION JOB_NAME TOOL ARGS...: srun (mmengine's `slurm` launcher), GPUS tasks
#   (default 8), GPUS_PER_NODE (GPUS, at most 8) of them and their GPUs on each node, CPUS_PER_TASK (5)
#   CPUs each, PORT (29500) as the master port, SRUN_ARGS added to srun's options.
# Both run TOOL (tools/TOOL) with the interpreter launch_python picks; with DRY_RUN=1 they print the
# command (shell-quoted, one line on stdout) and run nothing.

LAUNCH_SCRIPT=$(basename "$0")
LAUNCH_TOOLS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The modules tools/train.py and tools/test.py import, found without importing them (torch takes
# seconds to import). The empty path entry of `python -c` (the current folder) is left out: the
# tools run as scripts from tools/, where a posattn/ folder in the current folder is not on the path.
LAUNCH_NEEDS='torch posattn mmengine'
LAUNCH_CHECK='
import importlib.metadata, importlib.util, sys
sys.path[:] = [entry for entry in sys.path if entry != ""]
missing = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is None]
if missing:
    print(", ".join(missing))
    sys.exit(3)
print("Python %s, torch %s" % (sys.version.split()[0], importlib.metadata.version("torch")))
'

# Sets LAUNCH_PYTHON to the interpreter the tools run with: the checkout's virtual environment's
# (.venv, what `make setup` creates; VENV names another, as in `make setup VENV=...`) where it exists,
# else $PYTHON, else python on PATH. Says on stderr which one, and exits with the fix where it cannot
# import what the tools need.
launch_python() {
    local root venv origin fix found report status=0
    root=$(dirname "$LAUNCH_TOOLS")
    venv=${VENV:-.venv}
    [[ $venv = /* ]] || venv=$root/$venv
    if [ -x "$venv/bin/python" ]; then
        LAUNCH_PYTHON=$venv/bin/python
        origin=${VENV:+"VENV=$VENV"}
        origin=${origin:-"the checkout's .venv"}
        fix="Run \`make setup${VENV:+ VENV=$VENV}\` in $root: it installs them into ${VENV:-.venv}, which this script runs first."
    else
        if [ -n "${PYTHON:-}" ]; then
            LAUNCH_PYTHON=$PYTHON origin='the PYTHON variable'
        else
            LAUNCH_PYTHON=python origin='python on PATH'
        fi
        fix="Run \`make setup${VENV:+ VENV=$VENV}\` in $root (it creates ${VENV:-.venv}, which this script then runs), or set \
PYTHON to an interpreter that has them (pip install -e '$root[mm]' installs posattn with the OpenMMLab tools)."
    fi
    if ! found=$(command -v "$LAUNCH_PYTHON"); then
        echo "$LAUNCH_SCRIPT: no Python at '$LAUNCH_PYTHON' ($origin). $fix" >&2
        exit 1
    fi
    report=$("$LAUNCH_PYTHON" -c "$LAUNCH_CHECK" $LAUNCH_NEEDS 2>&1) || status=$?
    if [ "$status" = 3 ]; then
        echo "$LAUNCH_SCRIPT: $found ($origin) cannot import $report; the tools need ${LAUNCH_NEEDS// /, }. $fix" >&2
        exit 1
    elif [ "$status" != 0 ]; then
        echo "$LAUNCH_SCRIPT: $found ($origin) does not run: $report" >&2
        exit 1
    fi
    echo "$LAUNCH_SCRIPT: running $found ($origin; $report)" >&2
}

run_or_print() {
    if [ "${DRY_RUN:-0}" = 1 ]; then
        local quoted
        printf -v quoted '%q ' "$@"
        echo "${quoted% }"
    else
        exec "$@"
    fi
}

launch_torchrun() {
    local nproc=$1 tool=$2
    shift 2
    launch_python
    run_or_print "$LAUNCH_PYTHON" -m torch.distributed.run \
        --nnodes="${NNODES:-1}" \
        --node_rank="${NODE_RANK:-0}" \
        --master_addr="${MASTER_ADDR:-127.0.0.1}" \
        --master_port="${PORT:-29500}" \
        --nproc_per_node="$nproc" \
        "$LAUNCH_TOOLS/$tool" "$@" --launcher pytorch
}

launch_srun() {
    local partition=$1 job_name=$2 tool=$3 gpus=${GPUS:-8} srun_args
    shift 3
    local gpus_per_node=${GPUS_PER_NODE:-$((gpus < 8 ? gpus : 8))}
    read -r -a srun_args <<< "${SRUN_ARGS:-}"
    launch_python
    export MASTER_PORT=${PORT:-29500}
    run_or_print srun -p "$partition" \
        --job-name="$job_name" \
        --gres=gpu:"$gpus_per_node" \
        --ntasks="$gpus" \
        --ntasks-per-node="$gpus_per_node" \
        --cpus-per-task="${CPUS_PER_TASK:-5}" \
        --kill-on-bad-exit=1 \
        ${srun_args[@]+"${srun_args[@]}"} \
        "$LAUNCH_PYTHON" -u "$LAUNCH_TOOLS/$tool" "$@" --launcher slurm
}

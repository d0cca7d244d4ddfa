#!/usr/bin/env bash
# Build a wheel of mmcv 2.1.0 with its compiled ops (mmcv._ext) against the torch installed beside
# PYTHON, from the registry's source package. mmdet 3.3 and mmseg 1.2 need the compiled ops and
# refuse mmcv >= 2.2, and no mmcv 2.1.0 wheel exists for recent torch releases, hence the build:
#   - MMCV_WITH_OPS=1: compile the C++ ops (and the CUDA ops with FORCE_CUDA=1, see below);
#   - --no-build-isolation: build against the torch already installed, not a fresh one;
#   - setuptools >= 77.0.3 (what torch >= 2.9 requires) and < 81 (mmcv's setup.py imports
#     pkg_resources, which setuptools 81 removed);
#   - -std=c++17 -> -std=c++20 in setup.py: torch >= 2.13's headers refuse older standards.
#
# Usage: tools/build_mmcv.sh [--dry-run] PYTHON WHEEL_DIR
#   PYTHON     the interpreter of the environment that has torch (and will get mmcv)
#   WHEEL_DIR  where the wheel is written; nothing is built when it already holds one for PYTHON
#   --dry-run  resolve the build's pip steps against the pins (pip install --dry-run) and stop
# Environment: TORCH_PINS (default "torch==2.14.1 torchvision==0.29.1"), MAX_JOBS (parallel
# compiler jobs, default: the number of cores), FORCE_CUDA=1 with TORCH_CUDA_ARCH_LIST (for
# example "8.0;9.0") and CUDA_HOME to also compile the CUDA kernels (docs/openmmlab.md); the CUDA
# library headers that pip installed with torch are added to CPATH after the toolkit's.
# The wheel only fits the Python and torch it was built with; keep it to set up other machines
# of the same kind without building again (make WHEELS=WHEEL_DIR ...).
set -euo pipefail

MMCV_VERSION=2.1.0
# The build's own requirements, installed into PYTHON's environment beside the torch pins.
BUILD_REQS=('setuptools>=77.0.3,<81' 'wheel' 'ninja' 'psutil')

dry_run=0
if [ "${1:-}" = --dry-run ]; then dry_run=1; shift; fi
if [ $# -ne 2 ]; then
    echo "usage: $0 [--dry-run] PYTHON WHEEL_DIR" >&2
    exit 2
fi
PYTHON=$1
WHEEL_DIR=$2
read -r -a TORCH_PINS <<<"${TORCH_PINS:-torch==2.14.1 torchvision==0.29.1}"

if [ "$dry_run" = 1 ]; then
    "$PYTHON" -m pip install --dry-run --quiet "${BUILD_REQS[@]}" "${TORCH_PINS[@]}"
    echo "build requirements resolve with ${TORCH_PINS[*]}: ${BUILD_REQS[*]}"
    exit 0
fi

py_tag=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
existing=$(compgen -G "$WHEEL_DIR/mmcv-$MMCV_VERSION-$py_tag-*.whl" || true)
if [ -n "$existing" ]; then
    echo "mmcv $MMCV_VERSION wheel already built: $existing"
    exit 0
fi

"$PYTHON" -m pip install --quiet "${BUILD_REQS[@]}" "${TORCH_PINS[@]}"
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
kernels="C++ ops"
if [ "${FORCE_CUDA:-0}" = 1 ]; then
    kernels="C++ and CUDA ops (arch list: ${TORCH_CUDA_ARCH_LIST:-the default of torch})"
    # torch's headers include the CUDA libraries' (cusparse.h, cublas_v2.h, ...), which a bare
    # toolkit may lack: the copies pip installed with torch come after the toolkit's own.
    cuda_headers=$("$PYTHON" -c 'import glob, os, nvidia
print(next((os.path.dirname(p) for p in sorted(glob.glob(nvidia.__path__[0] + "/*/include/cusparse.h"))), ""))' 2>/dev/null || true)
    if [ -n "$cuda_headers" ]; then export CPATH=${CPATH:+$CPATH:}$cuda_headers; fi
fi
echo "Building mmcv $MMCV_VERSION with its $kernels for torch $torch_version on $py_tag," \
     "$MAX_JOBS compiler jobs: about 20-45 minutes on 2 cores, progress below."

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
    "mmcv==$MMCV_VERSION" -d "$work"
tar -xzf "$work/mmcv-$MMCV_VERSION.tar.gz" -C "$work"
src=$work/mmcv-$MMCV_VERSION
grep -q 'std=c++17' "$src/setup.py" || { echo "no -std=c++17 in mmcv's setup.py: check the c++20 patch" >&2; exit 1; }
sed -i -e 's/-std=c++17/-std=c++20/g' -e 's#/std:c++17#/std:c++20#g' "$src/setup.py"

# ninja numbers its steps ([12/77] ...): print one line per compiled source with the time so far
# and a linear estimate of what is left; the whole log stays in WHEEL_DIR for a failed build.
mkdir -p "$WHEEL_DIR"
log=$WHEEL_DIR/mmcv-$MMCV_VERSION-$py_tag-build.log
start=$SECONDS
report_progress() {
    local line done total file elapsed
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        [[ $line =~ ^[[:space:]]*\[([0-9]+)/([0-9]+)\] ]] || continue
        done=${BASH_REMATCH[1]} total=${BASH_REMATCH[2]}
        file=$(grep -oE '[^ ]+\.(cpp|cu)( |$)' <<<"$line" | tail -n 1 | sed -e 's#.*/mmcv/ops/csrc/##' -e 's/ $//' || true)
        elapsed=$((SECONDS - start))
        printf '  [%s/%s] %-48s %3d min elapsed, about %d min left\n' "$done" "$total" "${file:-linking}" \
            $((elapsed / 60)) $(((elapsed * (total - done) / done + 59) / 60))
    done
}
: >"$log"
if ! MMCV_WITH_OPS=1 "$PYTHON" -m pip wheel --verbose --no-build-isolation --no-deps \
        -w "$WHEEL_DIR" "$src" 2>&1 | report_progress; then
    echo "The mmcv build failed; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
fi
wheel=$(compgen -G "$WHEEL_DIR/mmcv-$MMCV_VERSION-$py_tag-*.whl")
"$PYTHON" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
if not any(n.startswith('mmcv/_ext') and n.endswith('.so') for n in names):
    sys.exit(f'{sys.argv[1]} has no compiled ops (mmcv/_ext*.so): the build skipped them')
EOF
echo "Built $wheel in $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s."

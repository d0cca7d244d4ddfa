#!/usr/bin/env bash
# Build mmcv 2.1.0 with its compiled ops (mmcv._ext) from the registry's source package, for
# machines without a prebuilt wheel (the Makefile uses ../shared/wheels/torch-2.14.1-cp311 when it
# exists and calls this otherwise). mmdet 3.3 and mmseg 1.2 need the compiled ops and refuse
# mmcv >= 2.2, and no mmcv 2.1.0 wheel exists for torch 2.14, hence the build:
#   - MMCV_WITH_OPS=1: compile the C++ (and, with FORCE_CUDA=1 on a GPU machine, CUDA) ops;
#   - --no-build-isolation: build against the torch already installed, not a fresh one;
#   - setuptools < 70 at build time: mmcv's setup.py needs APIs newer setuptools removed;
#   - c++17 -> c++20 in setup.py: torch >= 2.13's headers refuse older standards.
# Usage: PYTHON=.venv/bin/python TORCH_PINS="torch==2.14.1 torchvision==0.29.1" tools/build_mmcv.sh
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
TORCH_PINS=${TORCH_PINS:-torch==2.14.1 torchvision==0.29.1}
MMCV_VERSION=2.1.0

if "$PYTHON" -c "import mmcv, mmcv._ext; assert mmcv.__version__ == '$MMCV_VERSION'" 2>/dev/null; then
    echo "mmcv $MMCV_VERSION with compiled ops is already installed"
    exit 0
fi
echo "Building mmcv $MMCV_VERSION with its compiled ops from source: this takes 20-45 minutes" \
     "(put a prebuilt wheel in ../shared/wheels/torch-2.14.1-cp311/ to skip it)."
# shellcheck disable=SC2086  # TORCH_PINS is a list of requirements
"$PYTHON" -m pip install --quiet 'setuptools<70' wheel ninja psutil $TORCH_PINS
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
    "mmcv==$MMCV_VERSION" -d "$SRC"
tar -xzf "$SRC/mmcv-$MMCV_VERSION.tar.gz" -C "$SRC"
SETUP="$SRC/mmcv-$MMCV_VERSION/setup.py"
grep -q 'std=c++17' "$SETUP" || { echo "no -std=c++17 in $SETUP: check the c++20 patch" >&2; exit 1; }
sed -i -e 's/-std=c++17/-std=c++20/g' -e 's#/std:c++17#/std:c++20#g' "$SETUP"
# shellcheck disable=SC2086
MMCV_WITH_OPS=1 "$PYTHON" -m pip install --no-build-isolation "$SRC/mmcv-$MMCV_VERSION" $TORCH_PINS
"$PYTHON" -c "import torch, mmcv.ops; mmcv.ops.nms(torch.rand(4, 4).cumsum(1), torch.rand(4), 0.5); print('mmcv', mmcv.__version__, 'ops: ok')"

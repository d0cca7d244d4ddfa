# The README's two commands: `make run` (set up, then run the main job) and `make test`.
# Setup is idempotent: the virtual environment is made once and reinstalled only when
# pyproject.toml, this file or the mmcv build script changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Local pins: the package itself takes torch >= 2.4. These wheels come from the local index;
# passing them on every pip line keeps pip from ever resolving a torch from the registry.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
# mmcv 2.1.0 with compiled ops for torch 2.14.1 / CPython 3.11, prebuilt beside the checkout;
# without it, tools/build_mmcv.sh compiles mmcv from source (20-45 minutes).
MMCV_WHEELS := $(abspath $(ROOT)/../shared/wheels/torch-2.14.1-cp311)
ifneq ($(wildcard $(MMCV_WHEELS)/mmcv-*.whl),)
export PIP_FIND_LINKS := $(strip $(PIP_FIND_LINKS) $(MMCV_WHEELS))
BUILD_MMCV :=
else
BUILD_MMCV := PYTHON=$(BIN)/python TORCH_PINS="$(TORCH_PINS)" bash tools/build_mmcv.sh
endif

.PHONY: setup test run bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile tools/build_mmcv.sh | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	$(BUILD_MMCV)
	$(BIN)/python -m pip install --quiet -e '.[test,mm,analysis]' $(TORCH_PINS)
	touch $@

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest

# The main job: train PerViT-T on the embedded positional-shapes set (about 10 minutes on 2 CPU cores).
run: setup
	$(BIN)/python tools/train.py configs/pervit_t_shapes.py

bench: setup
	$(BIN)/python benchmarks/attention.py

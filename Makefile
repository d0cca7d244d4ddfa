# The README's two commands: `make run` (set up, then run the main job) and `make test`.
# Setup is idempotent: the virtual environment is made once and reinstalled only when
# pyproject.toml, this file or the mmcv build script changes.
#
# Variables (make VAR=value ...):
#   PYTHON          the interpreter the environment is made from (CPython 3.11 or 3.12)
#   VENV            where the environment goes
#   WHEELS          a folder of prebuilt wheels handed to pip; an mmcv 2.1.0 wheel there, built for
#                   torch 2.14.1 and this Python, replaces the 20-45 minute mmcv build. Optional;
#                   the default is wheels/torch-2.14.1-cpXY in a folder named shared beside the
#                   checkout, where one exists
#   MMCV_BUILD_DIR  where the mmcv build leaves its wheel, kept so that a new environment reuses it
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Local pins: the package itself takes torch >= 2.5. Passing them on every pip line keeps pip from
# ever resolving another torch.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
PY_TAG := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEELS ?= $(abspath $(ROOT)/../shared/wheels/torch-2.14.1-$(PY_TAG))
MMCV_BUILD_DIR ?= $(ROOT)/.wheels/torch-2.14.1-$(PY_TAG)
PREBUILT_MMCV := $(wildcard $(WHEELS)/mmcv-2.1.0-$(PY_TAG)-*.whl)
export PIP_FIND_LINKS := $(strip $(PIP_FIND_LINKS) $(wildcard $(WHEELS)) $(MMCV_BUILD_DIR))

.PHONY: setup test run bench mmcv-wheel

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile tools/build_mmcv.sh | $(BIN)/python
	mkdir -p $(MMCV_BUILD_DIR)
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	$(if $(PREBUILT_MMCV),@echo "mmcv: prebuilt $(PREBUILT_MMCV)",bash tools/build_mmcv.sh $(BIN)/python $(MMCV_BUILD_DIR))
	$(BIN)/python -m pip install --quiet --only-binary mmcv -e '.[test,mm,analysis]' $(TORCH_PINS)
	$(BIN)/python -m pip check
	touch $@

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest -m 'environment or not environment'

# The main job: train PerViT-T on the embedded positional-shapes set.
run: setup
	$(BIN)/python tools/train.py configs/pervit_t_shapes.py

bench: setup
	$(BIN)/python benchmarks/attention.py

# Build the mmcv wheel alone, into MMCV_BUILD_DIR: copy that folder to set up other machines of the
# same Python and torch without building again (make test WHEELS=<the copy>).
mmcv-wheel: | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	bash tools/build_mmcv.sh $(BIN)/python $(MMCV_BUILD_DIR)

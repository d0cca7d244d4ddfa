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

.PHONY: setup test run bench mmcv-wheel gpu-wheels gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile tools/build_mmcv.sh | $(BIN)/python
	mkdir -p $(MMCV_BUILD_DIR)
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	$(if $(PREBUILT_MMCV),@echo "mmcv: prebuilt $(PREBUILT_MMCV)",bash tools/build_mmcv.sh $(BIN)/python $(MMCV_BUILD_DIR))
	$(BIN)/python -m pip install --quiet --only-binary mmcv -e '.[test,mm,analysis,hf]' $(TORCH_PINS)
	$(BIN)/python -m pip check
	touch $@

setup: $(STAMP)

# One pytest worker a core, each on one thread (two threads a process on a shared core run many
# times slower), a test file to a worker so that its fixtures are made once, the longest files first
# (tests/conftest.py); the 25 slowest printed.
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m 'environment or not environment' -n auto --dist loadfile --no-loadscope-reorder --durations=25

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

# The GPU kit (docs/gpu.md). Here, with the package index at hand: make gpu-wheels.
# Then on the GPU machine, from a copy of this checkout that includes GPU_WHEELS, with no network:
# make gpu-check, then python benchmarks/report.py with the OUT folder. gpu-check runs the interpreter
# on PATH with its own torch (>= 2.5, whatever build the machine has), posattn installed from
# GPU_WHEELS without an index or dependencies into GPU_SITE, a folder put on PYTHONPATH for the run.
#   GPU_WHEELS  the wheels the GPU machine may lack, both pure Python: posattn's own, and einops'
#               (installed only where the interpreter has no einops); never torch
#   GPU_SITE    where gpu-check installs them
#   DEVICE      the device of the tests and benchmarks: cuda, or cpu to check the kit itself
#   OUT         the folder of the results (JSON, JUnit XML, logs, summary.json); an OUT in the
#               environment is used
#   QUICK       1: no slow tests, fewer rounds, no torch.compile stage (on the CPU every size is tiny)
#   BUDGET      seconds for the whole run (benchmarks/gpu_check.py's default: 450 on cuda, 1800 on cpu)
GPU_WHEELS ?= $(ROOT)/dist/gpu-wheels
GPU_SITE ?= $(ROOT)/build/gpu-site
DEVICE ?= cuda
OUT ?= $(ROOT)/build/gpu-check
QUICK ?=
BUDGET ?=

# posattn's wheel is built from a copy of the package's files, so that no stale build/ folder leaks into it.
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	staging=$$(mktemp -d) && cp -r pyproject.toml README.md LICENSE posattn integrations $$staging/ && \
	$(PYTHON) -m pip wheel --quiet --no-deps --wheel-dir $(GPU_WHEELS) $$staging 'einops>=0.7'; \
	status=$$?; rm -rf $$staging; exit $$status
	ls -l $(GPU_WHEELS)

gpu-check:
	rm -rf $(GPU_SITE)
	$(PYTHON) -m pip install --quiet --no-index --no-deps --find-links $(GPU_WHEELS) --target $(GPU_SITE) posattn \
		$$($(PYTHON) -c 'import einops' 2>/dev/null || echo einops)
	PYTHONPATH=$(GPU_SITE) $(PYTHON) benchmarks/gpu_check.py --device $(DEVICE) --out $(OUT) \
		$(if $(BUDGET),--budget $(BUDGET)) $(if $(filter 1 yes true,$(QUICK)),--quick)

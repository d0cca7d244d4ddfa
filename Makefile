# The README's two commands: `make run` (set up, then run the main job) and `make test`.
# Setup is idempotent: the virtual environment is made once and reinstalled only when
# pyproject.toml or this file changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Local pins: the package itself takes torch >= 2.4. These wheels come from the local index;
# pinning them first keeps pip from ever resolving a torch from the registry.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.PHONY: setup test run bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH_PINS)
	$(BIN)/python -m pip install --quiet -e '.[test]' $(TORCH_PINS)
	touch $@

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest

run: setup
	$(BIN)/python examples/quickstart.py

bench: setup
	$(BIN)/python benchmarks/attention.py

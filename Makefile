# Two commands work on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing, installs CPU PyTorch, then this package with its dev extras.
# CUDA users: create .venv yourself and install the torch build for your CUDA first
# (https://pytorch.org/get-started/locally/); `make` then keeps it, since torch>=2.4 is already met.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	MALLOC_MMAP_THRESHOLD_=65536 $(VENV)/bin/torchckpt demo

test: $(STAMP)
	MALLOC_MMAP_THRESHOLD_=65536 $(PY) -m pytest -q tests

bench: $(STAMP)
	@echo "make bench: the benchmark suite arrives with the benchmark issue; see bench/README.md" && exit 2

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# Two commands work on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing, installs CPU PyTorch, then this package with its dev extras, pinning the
# installed torch in the same pip call so that no extra (diffusers, peft, ...) can replace it.
# CUDA users: create .venv yourself and install the torch build for your CUDA first
# (https://pytorch.org/get-started/locally/); `make` then keeps it, since torch>=2.4 is already met.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all test-fast lint bench setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]" "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	touch $(STAMP)

setup: $(STAMP)

# `torchckpt train` with its defaults: gpt("mini") on the Python stdlib's source, 100 steps under a 28% budget
# (below what checkpointing every block needs),
# checkpoints in runs/demo. Run again: it reports the finished run (or resumes an interrupted one).
demo: $(STAMP)
	MALLOC_MMAP_THRESHOLD_=65536 $(VENV)/bin/torchckpt train

# The fast tier (what CI runs): every test not marked slow, on two pytest-xdist workers of one thread each
# (two threads each would oversubscribe two cores); each behaviour the
# slow tier checks is checked here too, at a small size. The 25 slowest tests are listed at the end.
test: $(STAMP)
	OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" --durations=25 tests

# Both tiers: the fast one plus soaks, multi-process kill trials, full-size benchmarks and big outside models.
test-all: $(STAMP)
	OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 $(PY) -m pytest -q -n 2 --dist worksteal --durations=25 tests

# The fast tier, stopping at the first failure.
test-fast: $(STAMP)
	MALLOC_MMAP_THRESHOLD_=65536 $(PY) -m pytest -q -x -m "not slow" tests

# ruff (rules in pyproject.toml's [tool.ruff]) and mypy ([tool.mypy]: src/torchckpt, bench/harness, bench/cuda_check.py).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

# The full benchmark against every peer (bench/README.md): ~30 min on a 2-core CPU. BENCH_ARGS=--quick for CI's.
bench: $(STAMP)
	MALLOC_MMAP_THRESHOLD_=65536 $(PY) bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

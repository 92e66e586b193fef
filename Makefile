# The README's commands: `make demo`, `make test` and `make test-fast`. All set up a virtualenv first.
#
# On a machine without an NVIDIA GPU the CPU build torch==2.13.0 is pinned (it lies on this
# workplace's disk; an unpinned torch pulls a multi-GB CUDA build). Set TORCH_SPEC to override,
# e.g. `make test TORCH_SPEC='torch>=2.6'` on a GPU machine that brings its own build.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.6' || echo 'torch==2.13.0')
# The example models' graphs (e.g. Llama's no-grad rotary embedding) change between transformers
# releases; the tests and benchmarks are checked against this one.
TRANSFORMERS_SPEC ?= transformers==5.23.0

.PHONY: setup demo test test-fast docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)' '$(TRANSFORMERS_SPEC)'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# The main job: a GPT-2 (8 layers, 8.4 M parameters) whose weights, gradients and Adam state do not
# fit one process's 200 MiB budget, planned into pipeline stages over 2 processes on this machine
# and trained (the loss falls; predicted against measured times at the end); then the 1.56 B-parameter
# GPT-2 XL planned for 8 H100s on the meta device. Plans, traces and figures go to demo/.
demo: setup
	$(VENV)/bin/partita train gpt2-small --seq-len 64 --nproc 2 --memory 200MiB --global-batch 8 --steps 30 \
		--plan-out demo/gpt2-small-plan.json --trace demo/gpt2-small-trace
	$(VENV)/bin/partita plan gpt2-xl --batch-size 2 --seq-len 1024 --devices 8 --device-type h100 --global-batch 64 \
		--out demo/gpt2-xl-plan.json --png demo/gpt2-xl.png --trace demo/gpt2-xl-trace.json
	@echo "demo/: plan files, the GPT-2 XL figure, Chrome/Perfetto traces (open them in https://ui.perfetto.dev)"

# Lint and format check first (ruff comes with the test extra), then the suite on two pytest-xdist
# workers (the machine's 2 cores: while one waits on its ranks, the other runs): each keeps a test
# file, or the users of one shared launch, together, and takes the groups longest first (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check partita tests bench
	$(VENV)/bin/ruff format --check partita tests bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

# The edit loop: the unit and golden tests that start no process (the markers dist and slow left
# out), on the same two workers.
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not dist and not slow" tests

# The API reference, docs/api.md, generated from the public names' docstrings (the suite checks it is current).
docs: setup
	$(PY) docs/api_reference.py

clean:
	rm -rf $(VENV) .pytest_cache

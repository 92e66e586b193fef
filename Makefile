# The README's two commands: `make demo` and `make test`. Both set up a virtualenv first.
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

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)' '$(TRANSFORMERS_SPEC)'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# The main job: plan the tiny GPT-2 for 2 processes on this machine and train it (the loss falls),
# then plan the 1.56 B-parameter GPT-2 XL for 8 H100s on the meta device.
demo: setup
	$(VENV)/bin/partita train gpt2 --nproc 2 --global-batch 16 --steps 40
	$(VENV)/bin/partita plan gpt2-xl --batch-size 2 --seq-len 1024 --devices 8 --device-type h100 --global-batch 64

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache

# Two commands do all the set-up on a fresh machine with Python >= 3.10:
#   make demo   the main job: a small multi-replica run on the embedded stdlib corpus
#   make test   the whole test suite: tests/unit, tests/dist (multi-process gloo), tests/e2e (launch runs)
#   make test-unit   the unit tier alone (under a minute)
# Both create and reuse ./.venv. Override the interpreter with PYTHON=..., and the
# PyTorch requirement installed when torch is absent with TORCH=... (e.g. TORCH='torch==2.6.0').

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.recover-installed

.PHONY: demo test test-unit lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "recover needs Python >= 3.10; found " + sys.version.split()[0] + " at " + sys.executable + ". Run: make PYTHON=python3.11 ...")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || { echo "installing $(TORCH) into $(VENV)"; $(PY) -m pip install -q "$(TORCH)"; }
	@$(PY) -m pip install -q -e '.[dev,export]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recover demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs data .pytest_cache

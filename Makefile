# Two commands do all the set-up on a fresh machine with Python >= 3.10:
#   make demo   the main job: a small multi-replica run on the embedded stdlib corpus
#   make test   the whole test suite: tests/unit, tests/dist (multi-process gloo), tests/e2e (launch runs),
#               all but the interop tests, spread over every core (11.9-13.6 min on 2 idle cores: over
#               the 8-minute budget, to be cut back)
#   make test-unit   the unit tier alone (about 60 s)
#   make test-interop   Hugging Face models and torchtitan's Llama 3 trained through recover.api, and the metrics
#                       files read by TensorBoard's and W&B's own readers (CI runs it too)
#   make test-slurm   the real-cluster tier: a real Slurm cluster and Prometheus on this machine (root; 8-11 min;
#                     CI runs it too)
#   make test-compat   tests/unit and tests/dist on the oldest torch pyproject.toml allows, in ./.venv-compat
#   make gpu-check   on a GPU node: check, test and benchmark everything one GPU can, into one report
#   make lint   ruff, then mypy over recovery/, comm/, coord/ and the API (CI runs it first)
# Both create and reuse ./.venv. Override the interpreter with PYTHON=..., and the
# PyTorch requirement installed when torch is absent with TORCH=... (e.g. TORCH='torch==2.11.0').

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.recover-installed

.PHONY: demo test test-unit test-interop test-slurm test-compat lint venv clean gpu-check

PY_CHECK := import sys; sys.exit(0 if sys.version_info >= (3, 10) else "recover needs Python >= 3.10; found " \
	+ sys.version.split()[0] + " at " + sys.executable + ". Run: make PYTHON=python3.11 ...")

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c '$(PY_CHECK)'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || { echo "installing $(TORCH) into $(VENV)"; $(PY) -m pip install -q "$(TORCH)"; }
	@$(PY) -m pip install -q -e '.[dev,export]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recover demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -m "not interop" -n auto --dist worksteal

# test-interop: other projects' model code (transformers' Llama and GPT-2, torchtitan's Llama 3) trained through
# recover.api under recover launch with a kill, a hang and a corruption (2.0 min measured with its installs; CI runs it after make test).
# torchtitan and the few modules its model code imports go in --no-deps, once (~16 MB, ~5-7 s): its declared
# dependencies would replace the CPU torch with a CUDA build and add datasets, wandb, tensorboard (GBs), none of
# which the model needs. It needs Python >= 3.11; with an older one its test is skipped.
TITAN := torchtitan==0.3.0 spmd-types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
TITAN_UNMET := import sys, re, importlib.metadata as md; \
	have = {re.sub(r"[-_.]+", "-", d.metadata["Name"].lower()) + "==" + d.version for d in md.distributions()}; \
	old = sys.version_info < (3, 11); \
	old and print("torchtitan needs Python >= 3.11: tests/e2e/test_own_loop_titan.py is skipped", file=sys.stderr); \
	sys.exit(not old and not have >= set(sys.argv[1:]))

# The metrics' readers: TensorBoard's event reader and W&B's offline run files (observe.*), with their dependencies
# (none of them touches torch); prometheus_client comes with the dev extra (make test uses it).
VIEWERS := tensorboard==2.21.0 wandb==0.31.0

test-interop: $(STAMP)
	@$(PY) -c '$(TITAN_UNMET)' $(TITAN) || { echo "installing $(TITAN) (--no-deps) into $(VENV)"; \
		$(PY) -m pip install -q --no-deps $(TITAN); }
	@$(PY) -c 'import tensorboard, wandb' 2>/dev/null || { echo "installing $(VIEWERS) into $(VENV)"; \
		$(PY) -m pip install -q $(VIEWERS); }
	$(PY) -m pytest -q -m interop tests/e2e

# test-slurm: the real-cluster tier (tests/cluster). A real Slurm cluster (Debian's slurm-wlm and munge: slurmctld
# and four slurmd, each node in a network namespace of its own) runs examples/slurm/recover.sbatch through a
# node's death, notices, the time limit, scancel, requeues and a coordinator kill, a real Prometheus scraping the
# coordinator; the Kubernetes manifests are checked against the API schema and their pods' commands run in
# namespaces. Needs root (namespaces); installs slurm-wlm, munge and prometheus with apt-get when absent
# (~2 min); without root or apt its tests are skipped with the reason. CI runs it after make test-interop.
K8S_VALIDATE := kubernetes-validate==1.37.0

test-slurm: $(STAMP)
	@$(PY) -c 'import kubernetes_validate' 2>/dev/null || { echo "installing $(K8S_VALIDATE) into $(VENV)"; \
		$(PY) -m pip install -q $(K8S_VALIDATE); }
	$(PY) -m pytest -q -p no:cacheprovider -rs --durations=0 tests/cluster

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# test-compat: the unit and multi-process tiers on the oldest torch that pyproject.toml allows ($(TORCH_COMPAT)), in
# its own venv $(VENV_COMPAT). Neither `make test` nor CI runs it: PyPI's Linux torch is a CUDA build whose nvidia-*
# wheels make that venv ~7 GB (minutes to install; the CPU tiers run on it without a GPU; ~3 min of tests).
# TORCH_COMPAT='torch==X' swaps the venv's torch for another version.
TORCH_COMPAT ?= torch==2.11.0
VENV_COMPAT  ?= .venv-compat
PY_COMPAT    := $(VENV_COMPAT)/bin/python

$(VENV_COMPAT)/.recover-installed: pyproject.toml
	@$(PYTHON) -c '$(PY_CHECK)'
	@test -x $(PY_COMPAT) || $(PYTHON) -m venv $(VENV_COMPAT)
	@$(PY_COMPAT) -m pip install -q "$(TORCH_COMPAT)" -e '.[dev,export]'
	@touch $@

test-compat: $(VENV_COMPAT)/.recover-installed
	@$(PY_COMPAT) -m pip install -q "$(TORCH_COMPAT)"
	@$(PY_COMPAT) -c 'import torch; print("test-compat: torch", torch.__version__)'
	$(PY_COMPAT) -m pytest -q -p no:cacheprovider tests/unit tests/dist

# gpu-check: recover check, tests/e2e/test_gpu.py, recover bench gpu (125m and 1b, compiled and eager, a kill
# and a rejoin) into $(GPU_CHECK_OUT)/REPORT.md; exit status 0 when every stage passed (~15 min on an H100;
# GPU_CHECK_FLAGS=--quick: ~8 min, 125m eager only).
# When $(PYTHON)'s torch sees a CUDA GPU it runs with that interpreter as it is: GPU nodes carry their own
# CUDA build of PyTorch and often no network, so nothing is installed and no venv is made; recover runs from
# this checkout through PYTHONPATH=src (every child process inherits it), which writes nothing outside
# $(GPU_CHECK_OUT) and cannot shadow the node's torch. Otherwise it falls back to $(VENV) (made by `make venv`
# only if it has no torch) and the CPU path, skipping the GPU stages with the reason in the report.
GPU_CHECK_OUT ?= runs/gpu-check
GPU_CHECK_FLAGS ?=
CUDA_TORCH := import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)

gpu-check:
	@if $(PYTHON) -c '$(CUDA_TORCH)' >/dev/null 2>&1; then \
		PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m recover.ops.gpucheck --device cuda --out $(GPU_CHECK_OUT) $(GPU_CHECK_FLAGS); \
	else \
		echo "gpu-check: $(PYTHON) has no CUDA build of torch with a visible GPU: the CPU path, with $(PY)"; \
		$(PY) -c 'import torch' >/dev/null 2>&1 || $(MAKE) --no-print-directory venv || exit 1; \
		PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m recover.ops.gpucheck --device cpu --out $(GPU_CHECK_OUT) $(GPU_CHECK_FLAGS); \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	@$(PY) -c 'import mypy' 2>/dev/null || { echo "installing the type checker (.[typing]) into $(VENV)"; \
		$(PY) -m pip install -q -e '.[typing]'; }
	$(PY) -m mypy

clean:
	rm -rf $(VENV) runs data .pytest_cache

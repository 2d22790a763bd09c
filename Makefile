# Two commands do all set-up on a fresh machine:
#   make serve   - venv + Debian packages, export the models, start tritonserver (Ctrl-C stops)
#   make test    - the same set-up, then unit and integration tests against a real tritonserver
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: venv export serve test test-unit test-integration perf-baseline clean

$(STAMP): requirements.txt requirements-gpu.txt constraints.txt pyproject.toml scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh
	touch $@

venv: $(STAMP)

export: $(STAMP)
	$(PY) -m export

serve: $(STAMP)
	$(PY) -m server $(SERVE_ARGS)

test: $(STAMP)
	$(PY) -m export
	$(PY) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(PY) -m export
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# First throughput/P99 figures of the ensemble with perf_analyzer (server must be running).
perf-baseline: $(STAMP)
	$(PY) -m perf.baseline

clean:
	rm -rf .triton perf/results
	find model_repository -name '*.onnx' -o -name '*.export.json' -o -name tokenizer.json | xargs rm -f

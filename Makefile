# agent-recovery — `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Processes of `make test` (pytest-xdist): the crash tests mostly wait for leases and worker
# boots, so 4 pay even on 2 cores (against 3: 484/596/574 s against 586/601/671 s, alternating,
# 2026-12-03 22:07-23:14 UTC). TEST_WORKERS=0 runs the suite in one process. At most 5: each
# process takes three Redis databases of TEST_REDIS_URL (tests/conftest.py).
TEST_WORKERS ?= 4

.PHONY: help setup test lint typecheck demo clean bytecode

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(MAKE) --no-print-directory bytecode
	touch $(STAMP)

# The project is installed editable, so pip compiles none of its modules; where the environment
# sets PYTHONDONTWRITEBYTECODE, every worker boot would compile them from source (~0.13 s of
# CPU a restart, measured). A stale .pyc is only ignored (Python checks each source's mtime).
bytecode: ## compile the project's modules (what a non-editable install does)
	$(BIN)/python -m compileall -q -j 0 -x '/(\.venv|tests|\.git)/' .

setup: $(STAMP) ## create .venv and install the project with its dev extras

test: $(STAMP) ## the whole suite (unit, integration, crash, browser) in TEST_WORKERS processes, a throwaway PostgreSQL database each
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || [ -x "$$CHROMIUM" ] || \
	  echo "make test: no Chromium found (apt-get install chromium): the console's browser tests (tests/browser) are SKIPPED"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: $(STAMP) ## ruff lint + format check, mypy on the domain packages
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy models harness recovery fieldrecovery console

demo: $(STAMP) ## a parent delegates, a worker is SIGKILLed mid-flight, a new worker recovers
	$(BIN)/python -m demo

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

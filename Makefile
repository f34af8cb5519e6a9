# Two commands matter: `make run` (set up, then run the embedded default loop)
# and `make test` (set up, lint and type-check, then run the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run lint bytecode test test-unit test-integration test-all bench clean
PACKAGES := protocol rollout learner services
setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/inflight run

# ruff and pyright (rule sets and their reasons: pyproject.toml); both must report nothing.
lint: setup
	$(VENV)/bin/ruff check $(PACKAGES)
	$(VENV)/bin/pyright -p pyproject.toml $(PACKAGES)

# Two tiers (docs/testing.md): unit tests touch no Ray, vLLM engine or process group (tests/unit_guard.py) and run
# in parallel; integration tests share one stack per session, in INTEGRATION_WORKERS xdist workers (each with its
# own session stacks; a module, or the modules sharing a stack, on one worker: tests/integration/conftest.py;
# INTEGRATION_WORKERS=0 runs them in one process). Each tier writes its modules' seconds to test-durations/ and
# fails when a module exceeds its budget in tests/budgets.toml.
INTEGRATION_WORKERS ?= 2
BUDGETS := --budgets tests/budgets.toml
test: setup lint test-unit test-integration

# The project's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (this machine's shell sets it) every
# process of a run (Ray actors, engines, CLI subprocesses: hundreds in the integration tier) would otherwise compile
# the modules it imports again (~0.25 s each). compileall writes them whatever that variable says; a stale file is
# recompiled in memory, never trusted.
bytecode: setup
	$(PY) -m compileall -q -j 0 $(PACKAGES) tests > /dev/null

test-unit: setup bytecode
	$(PY) -m pytest -n auto --dist loadfile -m "not gpu and not slow" --durations=15 \
		--durations-out test-durations/unit.json $(BUDGETS) tests/unit

test-integration: setup bytecode
	$(PY) -m pytest -n $(INTEGRATION_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not gpu and not slow" \
		--durations=30 --durations-out test-durations/integration.json $(BUDGETS) tests/integration

test-all: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) runs results .pytest_cache

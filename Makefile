# Two commands matter: `make run` (set up, then run the embedded default loop)
# and `make test` (set up, then run the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-all bench clean
setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/inflight run

test: setup
	$(PY) -m pytest -m "not gpu and not slow" tests

test-all: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) runs results .pytest_cache

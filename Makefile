# streamrl: the two commands of README.md, plus developer targets.
.PHONY: setup demo test test-unit test-integration lint up bench-bus

export OMP_NUM_THREADS ?= 2
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
PY := .venv/bin/python

setup:
	@scripts/setup.sh

## demo: set up if needed, prepare the arithmetic task (data, tiny model, warm start), run GRPO
## from scratch (a previous runs/demo is removed; `streamrl up recipes/demo.toml` alone resumes it).
demo: setup
	$(PY) examples/arithmetic/prepare.py recipes/demo.toml
	rm -rf runs/demo
	.venv/bin/streamrl up recipes/demo.toml

## test: set up if needed, then run the whole test suite (CPU, real Redis, real vLLM/DeepSpeed): every tier below.
test: setup
	$(PY) -m pytest -q --durations=30

## test-unit: the quick loop to run on every edit (under 2 minutes on 2 cores): tests/unit, one process, no Redis,
## no child process (tests/unit/conftest.py fails a test that tries), no real engine run.
test-unit: setup
	$(PY) -m pytest -q tests/unit

## test-integration: what needs a real redis-server, child processes, real engines or external tools (kubectl).
test-integration: setup
	$(PY) -m pytest -q tests/integration tests/e2e tests/faults tests/deploy

lint: setup
	.venv/bin/ruff check libs services tests bench examples

up: setup
	.venv/bin/streamrl up $(RECIPE)

bench-bus: setup
	$(PY) bench/bus.py

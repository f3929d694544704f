"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def random_cache(tmp_path_factory):
    """The random-weight models of the --tiny workloads, built into a cache of each test
    module (KVBATCH_CACHE points there while the module runs)."""
    root = tmp_path_factory.mktemp("kvbatch-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBATCH_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("eos-llama"), eos_bias=True)

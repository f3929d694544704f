"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def random_cache(tmp_path_factory):
    """The random-weight models of the --tiny workloads, built into a cache of each test
    module (KVBATCH_CACHE points there while the module runs)."""
    root = tmp_path_factory.mktemp("kvbatch-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBATCH_CACHE", str(root))
        yield root

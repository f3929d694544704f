"""Quantized tiny checkpoints, written once per session by compressed-tensors."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ct_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`get(scheme) -> Path`: the tiny Llama quantized with `scheme` (ct_checkpoints.SCHEMES)
    by compressed-tensors, built on first request."""
    from tests.engine.quant.ct_checkpoints import build_ct_checkpoint

    root = tmp_path_factory.mktemp("ct_checkpoints")
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(scheme: str) -> Path:
        with lock:
            if scheme not in built:
                built[scheme] = build_ct_checkpoint(scheme, root / scheme)
            return built[scheme]

    return get


@pytest.fixture(scope="session")
def moe_ct_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """`get(kind, scheme) -> (path, reference model)`: a tiny MoE model of `kind` quantized
    with `scheme` by compressed-tensors (moe_checkpoints.py), built on first request."""
    from tests.engine.quant.moe_checkpoints import build_moe_ct_checkpoint

    root = tmp_path_factory.mktemp("moe_ct_checkpoints")
    built: dict[tuple[str, str], tuple] = {}
    lock = threading.Lock()

    def get(kind: str, scheme: str):
        with lock:
            if (kind, scheme) not in built:
                built[kind, scheme] = build_moe_ct_checkpoint(kind, scheme, root / kind / scheme)
            return built[kind, scheme]

    return get

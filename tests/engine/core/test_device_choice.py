"""Asking for CUDA where torch has none is a one-line error that says what to do, not an
AssertionError from deep inside torch."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.core.config import EngineConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda is valid here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_names_the_fix(device):
    with pytest.raises(ValueError, match="use --device cpu, or install torch's CUDA build"):
        EngineConfig(model="unused", device=device).torch_device()


def test_auto_and_cpu_pick_a_device_that_exists():
    assert EngineConfig(model="unused", device="cpu").torch_device().type == "cpu"
    auto = EngineConfig(model="unused", device="auto").torch_device()
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")

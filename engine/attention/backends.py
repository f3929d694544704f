"""The attention backends by name, and the choice `attention_backend="auto"` makes."""

from __future__ import annotations

import torch

from kvbatch.engine.attention.metadata import AttentionBackend
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.engine.attention.triton_backend import TritonAttentionBackend
from kvbatch.kernels.interpreter import interpreter_problem, interpreting

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick an attention backend by name: `auto` is triton on CUDA and torch on the CPU.

    triton on the CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests).
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is not available; choose one of: auto, "
            + ", ".join(BACKENDS)
        )
    if name == "triton" and device.type != "cuda":
        if not interpreting():
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (on the CPU it runs only under "
                "TRITON_INTERPRET=1, for testing): use attention_backend='torch' or 'auto'"
            )
        problem = interpreter_problem()
        if problem:
            raise ValueError(problem)
    return BACKENDS[name]()

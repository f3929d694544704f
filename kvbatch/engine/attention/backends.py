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


def get_backend(
    name: str, device: torch.device, kv_dtype: torch.dtype | None = None
) -> AttentionBackend:
    """Pick an attention backend by name: `auto` is triton on CUDA and torch on the CPU.

    triton on the CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests).
    An FP8 KV cache (`kv_dtype` float8_e4m3fn) needs FP8 in Triton, which starts at sm_89:
    on older GPUs `auto` picks torch and an explicit triton is refused.
    """
    fp8_unsupported = (
        kv_dtype == torch.float8_e4m3fn
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    )
    if name == "auto":
        name = "triton" if device.type == "cuda" and not fp8_unsupported else "torch"
    if name == "triton" and fp8_unsupported:
        raise ValueError(
            "kv_cache_dtype='fp8' with attention_backend='triton' needs an sm_89+ GPU (Ada, "
            "Hopper): use attention_backend='torch' or kv_cache_dtype='auto' on this one"
        )
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

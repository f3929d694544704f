"""kvbatch's inference engine: paged KV cache, continuous batching, prefix caching.

    from engine import LLM, SamplingParams

Names are imported lazily so that `engine.fetch` (and commands that never run a model) do not
pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineStats": "engine.outputs",
    "SpecConfig": "engine.config",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

"""kvbatch's inference engine: paged KV cache, continuous batching, prefix caching.

    from kvbatch.engine import LLM, SamplingParams

Names are imported lazily so that `kvbatch.fetch` (and commands that never run a model) do not
pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what editors and type checkers follow; at run time __getattr__ imports
    from kvbatch.engine.core.args import EngineArgs as EngineArgs
    from kvbatch.engine.core.llm import LLM as LLM
    from kvbatch.engine.core.llm_engine import LLMEngine as LLMEngine
    from kvbatch.engine.core.outputs import CompletionOutput as CompletionOutput
    from kvbatch.engine.core.outputs import EngineStats as EngineStats
    from kvbatch.engine.core.outputs import RequestOutput as RequestOutput
    from kvbatch.engine.core.prompt_input import ContextLengthError as ContextLengthError
    from kvbatch.engine.core.sampling_params import SamplingParams as SamplingParams
    from kvbatch.engine.core.spec_config import SpecConfig as SpecConfig
    from kvbatch.engine.structured.params import StructuredOutputs as StructuredOutputs

_EXPORTS = {
    "LLM": "kvbatch.engine.core.llm",
    "EngineArgs": "kvbatch.engine.core.args",
    "LLMEngine": "kvbatch.engine.core.llm_engine",
    "SamplingParams": "kvbatch.engine.core.sampling_params",
    "StructuredOutputs": "kvbatch.engine.structured.params",
    "RequestOutput": "kvbatch.engine.core.outputs",
    "CompletionOutput": "kvbatch.engine.core.outputs",
    "EngineStats": "kvbatch.engine.core.outputs",
    "SpecConfig": "kvbatch.engine.core.spec_config",
    "ContextLengthError": "kvbatch.engine.core.prompt_input",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvbatch.engine' has no attribute {name!r}")

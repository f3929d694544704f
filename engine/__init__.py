"""kvbatch's inference engine: paged KV cache, continuous batching, prefix caching.

    from engine import LLM, SamplingParams
"""

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineStats"]

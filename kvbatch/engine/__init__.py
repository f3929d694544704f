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
    from kvbatch.engine.core.sampling_params import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS
    from kvbatch.engine.core.sampling_params import MAX_N as MAX_N
    from kvbatch.engine.core.sampling_params import MAX_PENALTY as MAX_PENALTY
    from kvbatch.engine.core.sampling_params import (
        MAX_REPETITION_PENALTY as MAX_REPETITION_PENALTY,
    )
    from kvbatch.engine.core.sampling_params import (
        MIN_REPETITION_PENALTY as MIN_REPETITION_PENALTY,
    )
    from kvbatch.engine.core.sampling_params import SamplingParams as SamplingParams
    from kvbatch.engine.core.sequence import TokenLogprobs as TokenLogprobs
    from kvbatch.engine.core.spec_config import SpecConfig as SpecConfig
    from kvbatch.engine.kv.context_len import CAPPED_AT_POOL as CAPPED_AT_POOL
    from kvbatch.engine.kv.kv_cache import block_hashes as block_hashes
    from kvbatch.engine.model.architectures import ENCODER_ARCHITECTURES as ENCODER_ARCHITECTURES
    from kvbatch.engine.model.architectures import (
        encoder_max_input_length as encoder_max_input_length,
    )
    from kvbatch.engine.pooling.config import read_st_max_seq_length as read_st_max_seq_length
    from kvbatch.engine.pooling.inputs import EmbeddingPrompt as EmbeddingPrompt
    from kvbatch.engine.pooling.inputs import embedding_inputs as embedding_inputs
    from kvbatch.engine.pooling.matryoshka import truncate_dimensions as truncate_dimensions
    from kvbatch.engine.pooling.outputs import EmbeddingOutput as EmbeddingOutput
    from kvbatch.engine.pooling.pairs import as_pairs as as_pairs
    from kvbatch.engine.pooling.score_pairs import reranker_prompt as reranker_prompt
    from kvbatch.engine.pooling.yes_no import LAST_STATE as LAST_STATE
    from kvbatch.engine.pooling.yes_no import YesNoReranker as YesNoReranker
    from kvbatch.engine.reasoning.byte_level import bytes_to_unicode as bytes_to_unicode
    from kvbatch.engine.reasoning.harmony_prompt import (
        render_harmony_prompt as render_harmony_prompt,
    )
    from kvbatch.engine.reasoning.parser import ReasoningParser as ReasoningParser
    from kvbatch.engine.reasoning.parser import ReasoningSplit as ReasoningSplit
    from kvbatch.engine.reasoning.registry import HARMONY_PARSER as HARMONY_PARSER
    from kvbatch.engine.reasoning.registry import NO_REASONING_PARSER as NO_REASONING_PARSER
    from kvbatch.engine.reasoning.registry import (
        detect_reasoning_parser as detect_reasoning_parser,
    )
    from kvbatch.engine.structured.enforced import unenforced as unenforced
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
    # what the jobs layer builds on (kvbatch.jobs, kvbatch.worker import nothing else of the
    # engine): request limits, logprobs, the prefix cache's block hashes (prefix grouping),
    # an encoder's input length, embeddings' inputs and vectors
    "MAX_LOGIT_BIAS": "kvbatch.engine.core.sampling_params",
    "MAX_N": "kvbatch.engine.core.sampling_params",
    "MAX_PENALTY": "kvbatch.engine.core.sampling_params",
    "MIN_REPETITION_PENALTY": "kvbatch.engine.core.sampling_params",
    "MAX_REPETITION_PENALTY": "kvbatch.engine.core.sampling_params",
    "unenforced": "kvbatch.engine.structured.enforced",  # strict structured outputs
    "TokenLogprobs": "kvbatch.engine.core.sequence",
    "block_hashes": "kvbatch.engine.kv.kv_cache",
    "CAPPED_AT_POOL": "kvbatch.engine.kv.context_len",  # why a job's context was cut
    "ENCODER_ARCHITECTURES": "kvbatch.engine.model.architectures",
    "encoder_max_input_length": "kvbatch.engine.model.architectures",
    "read_st_max_seq_length": "kvbatch.engine.pooling.config",
    "EmbeddingPrompt": "kvbatch.engine.pooling.inputs",
    "embedding_inputs": "kvbatch.engine.pooling.inputs",
    "truncate_dimensions": "kvbatch.engine.pooling.matryoshka",
    "EmbeddingOutput": "kvbatch.engine.pooling.outputs",
    # scoring pairs (score and rerank lines): vLLM's pairing, and decoder rerankers' prompts,
    # pooling and yes/no projection
    "as_pairs": "kvbatch.engine.pooling.pairs",
    "reranker_prompt": "kvbatch.engine.pooling.score_pairs",
    "LAST_STATE": "kvbatch.engine.pooling.yes_no",
    "YesNoReranker": "kvbatch.engine.pooling.yes_no",
    # reasoning models: the parser's split of an answer, the parser a model calls for, and
    # gpt-oss's prompts (openai-harmony renders them)
    "ReasoningParser": "kvbatch.engine.reasoning.parser",
    "bytes_to_unicode": "kvbatch.engine.reasoning.byte_level",
    "ReasoningSplit": "kvbatch.engine.reasoning.parser",
    "detect_reasoning_parser": "kvbatch.engine.reasoning.registry",
    "HARMONY_PARSER": "kvbatch.engine.reasoning.registry",
    "NO_REASONING_PARSER": "kvbatch.engine.reasoning.registry",
    "render_harmony_prompt": "kvbatch.engine.reasoning.harmony_prompt",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvbatch.engine' has no attribute {name!r}")

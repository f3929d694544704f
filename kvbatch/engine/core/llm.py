"""`LLM`: the offline API, close to vLLM's `LLM.generate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbatch.engine.core.args import EngineArgs, EngineKwargs
from kvbatch.engine.core.chat import (
    Conversation,
    as_conversations,
    render_chat,
    require_chat_template,
)
from kvbatch.engine.core.config import EngineConfig
from kvbatch.engine.core.llm_engine import LLMEngine
from kvbatch.engine.core.outputs import CompletionOutput, EngineStats, RequestOutput
from kvbatch.engine.core.prompt_input import PromptType
from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.encoder.engine import EncoderEngine
from kvbatch.engine.model.loader import is_encoder_checkpoint
from kvbatch.engine.pooling.inputs import embedding_inputs
from kvbatch.engine.pooling.matryoshka import check_dimensions, truncate_dimensions
from kvbatch.engine.pooling.score_pairs import as_pairs, score_pairs
from kvbatch.hub import resolve_model

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's; type checkers read this one on 3.10 too
    from typing_extensions import Unpack


class LLM:
    """Load a model once, then generate for many prompts at a time.

    >>> llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")  # or a folder, or a .gguf
    >>> outs = llm.chat([{"role": "user", "content": "Name three primary colours."}],
    ...                 SamplingParams(max_tokens=32, temperature=0))
    """

    def __init__(self, model: str, **settings: Unpack[EngineKwargs]) -> None:
        """`model`: a Hugging Face folder, a .gguf file or a Hub id (kvbatch.hub; `revision`
        picks its branch, tag or commit). `settings`: EngineArgs' fields (engine/core/args.py,
        the table in docs/ENGINE.md), e.g. `max_num_seqs=64`, `speculative="ngram"` or
        `quantization="fp8"`; each left out keeps its default, some chosen by device."""
        args = EngineArgs.from_keywords(settings)
        config = EngineConfig.from_args(resolve_model(model, args.revision), args)
        # an encoder checkpoint (BERT, RoBERTa) gets the encoder engine: the same streaming
        # API, embeddings only, no KV cache (engine/encoder/)
        encoder = is_encoder_checkpoint(config.model)
        self.engine = EncoderEngine(config) if encoder else LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt that cannot run (too long, empty, bad token ids) gets an output with
        `error` set and finish_reason "error"; the other prompts still run.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.engine
        results: dict[int, RequestOutput] = {}
        index_of: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if isinstance(prompt, _Rejected):
                results[i] = _error_output(str(i), None, prompt.reason)
                continue
            try:
                index_of[engine.add_request(prompt, p, request_id=f"generate-{id(self)}-{i}")] = i
            except ValueError as e:
                results[i] = _error_output(str(i), prompt, str(e))
        bar = _progress(len(index_of)) if use_tqdm else None
        while engine.has_unfinished():
            for out in engine.step():
                results[index_of[out.request_id]] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in range(len(prompts))]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation ([{"role": ..., "content": ...}, ...]) or a list of them,
        through the model's chat template (or `chat_template`), as vLLM's `LLM.chat`; one
        output per conversation, in input order. `tools` (OpenAI function definitions) go to
        the template as vLLM passes them; the answer is text, for the caller's parser (batch
        jobs read calls with kvbatch.jobs.openai_format.tool_parsers). A conversation the template rejects
        gets an output with `error` set; the others still run."""
        conversations = as_conversations(messages)
        require_chat_template(self.tokenizer, chat_template)
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts: list = []
        for conversation in conversations:
            try:
                prompts.append(
                    render_chat(
                        self.tokenizer,
                        conversation,
                        chat_template=chat_template,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        chat_template_kwargs=chat_template_kwargs,
                    )
                )
            except Exception as e:  # jinja errors, raise_exception() in a template
                prompts.append(_Rejected(f"the chat template rejects this conversation: {e}"))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        inputs: str | list[str] | list[int] | list[list[int]],
        dimensions: int | None = None,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """One vector per input, in input order: the model's pooling (its sentence-transformers
        files, else last token, normalised) of the prompt's final hidden states, computed by
        prefill alone. `inputs` as OpenAI's embeddings `input`: a string, a list of strings, a
        list of token ids or a list of such lists. `dimensions` keeps the first components
        (Matryoshka), renormalised when the model normalises.

        Raises ValueError naming the input at fault (empty, too long, bad token id,
        dimensions out of range); nothing runs then.
        """
        prompts = embedding_inputs(inputs)
        engine = self.engine
        check_dimensions(dimensions, engine.model_config.hidden_size)
        index_of: dict[str, int] = {}
        for i, prompt in enumerate(prompts):
            try:
                rid = engine.add_embedding_request(prompt, request_id=f"embed-{id(self)}-{i}")
            except ValueError as e:
                for rid in index_of:
                    engine.abort_request(rid)
                raise ValueError(f"input {i}: {e}") from e
            index_of[rid] = i
        vectors: dict[int, object] = {}
        bar = _progress(len(index_of), "embed") if use_tqdm else None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in index_of:
                    vectors[index_of[out.request_id]] = out.embedding
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        stacked = torch.stack([vectors[i] for i in range(len(prompts))])
        normalize = engine.pooling_config.normalize
        return truncate_dimensions(stacked, dimensions, normalize).tolist()

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate: bool = False,
    ) -> list[float | list[float]]:
        """Relevance scores of (query, document) pairs, as vLLM's LLM.score pairs them: one
        text against many, or two lists item by item. The model is a cross-encoder (BERT-family
        ...ForSequenceClassification: sigmoid of its logit, as sentence-transformers'
        CrossEncoder) or a decoder reranker (Qwen3-Reranker: sigmoid(logit yes - logit no)
        after its chat template). A pair longer than the model takes raises ValueError,
        unless `truncate` (the document is cut). engine/pooling/score_pairs.py."""
        return score_pairs(self.engine, as_pairs(text_1, text_2), truncate, f"score-{id(self)}")

    def stats(self) -> EngineStats:
        return self.engine.stats()


@dataclass(frozen=True)
class _Rejected:
    """A prompt that never reaches the engine (its chat template failed), and why."""

    reason: str


def _error_output(request_id: str, prompt, message: str) -> RequestOutput:
    ids = prompt if isinstance(prompt, list) else []
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=ids,
        outputs=[CompletionOutput(0, "", [], "error")],
        finished=True,
        error=message,
    )


def _progress(total: int, desc: str = "generate"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req")

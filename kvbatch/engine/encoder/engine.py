"""The encoder engine: LLMEngine's streaming API (add requests, step() until done) for encoder
checkpoints: embeddings, or a cross-encoder's pair scores.

Each step runs one padded batch (batches.py) through the whole model, pools it as the
checkpoint's sentence-transformers files say (the decoder engine's Pooler, fed each input's
rows whole) and returns an EmbeddingOutput per request. No KV cache is allocated: the cache,
prefix-caching, chunking and graph settings of EngineConfig have nothing to act on here.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from kvbatch.engine.core.config import EngineConfig, default_batched_tokens
from kvbatch.engine.core.outputs import EngineStats
from kvbatch.engine.core.prompt_input import (
    PromptType,
    check_embedding_input,
    prompt_token_ids,
)
from kvbatch.engine.encoder.batches import EncoderRequest, LengthBatcher
from kvbatch.engine.model.loader import load_encoder
from kvbatch.engine.pooling.config import (
    PoolingConfig,
    PoolingMethod,
    read_pooling_config,
    read_st_max_seq_length,
)
from kvbatch.engine.pooling.outputs import EmbeddingOutput
from kvbatch.engine.pooling.pooler import Pooler, PoolingChunk
from kvbatch.engine.pooling.scores import ScoreOutput, as_scores, score_activation

log = logging.getLogger(__name__)


class EncoderEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Load the encoder and its pooling; refuse the options that cannot apply to it."""
        _refuse_decoder_options(config)
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        loaded = load_encoder(config.model, self.dtype, self.device)
        self.model, self.model_config = loaded.model, loaded.config
        self.tokenizer, self.weight_bytes = loaded.tokenizer, loaded.weight_bytes
        self.head = loaded.head  # a cross-encoder's classification head: it scores pairs
        if self.head is None:
            self.pooling_config = _encoder_pooling(config.model, loaded.config.architecture)
        else:
            self.pooling_config = PoolingConfig(PoolingMethod.CLS, normalize=False)
            self.activation = score_activation(config.model, loaded.config.num_labels)
        self.max_model_len = self._max_model_len()
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.max_batch_tokens = sched.max_num_batched_tokens or default_batched_tokens(self.device)
        self.scheduler = LengthBatcher()  # `scheduler`: the name worker metrics read
        self.pooler = Pooler()
        self.spec = None  # no speculative decoding: there is nothing to decode
        self._ids = itertools.count()
        self._num_requests = self._num_finished = self._num_steps = 0
        self._prompt_tokens = self._computed = 0
        log.info(
            "encoder %s: %.1f MiB of weights (%s), %s%s, inputs up to %d tokens, "
            "batches of up to %d padded tokens; no KV cache",
            self.model_config.architecture,
            self.weight_bytes / (1 << 20),
            str(self.dtype).removeprefix("torch."),
            "scores pairs" if self.head is not None else self.pooling_config.method.value,
            " pooling, normalised" if self.pooling_config.normalize else "",
            self.max_model_len,
            self.max_batch_tokens,
        )

    def _max_model_len(self) -> int:
        """max_model_len if asked (up to the position embeddings), else the length
        sentence-transformers truncates to: a longer input is refused rather than embedded
        past the length the model is used with (vLLM caps it there too). The positions hold
        max_position_embeddings tokens, less pad_token_id + 1 for RoBERTa (514 -> 512)."""
        limit = self.model_config.max_input_length
        asked = self.config.scheduler.max_model_len
        if asked > limit:
            raise ValueError(
                f"max_model_len={asked} exceeds the model's {limit} input positions "
                f"(max_position_embeddings={self.model_config.max_position_embeddings})"
            )
        st_limit = read_st_max_seq_length(self.config.model, self.tokenizer)
        return asked or min(limit, st_limit or limit)

    # -- requests ---------------------------------------------------------------------------

    def add_embedding_request(self, prompt: PromptType, request_id: str | None = None) -> str:
        """Queue one input to embed. Raises ValueError (naming the problem) for an empty
        input, a bad token id, or more tokens than max_model_len (never truncated)."""
        if self.head is not None:
            raise ValueError(
                f"this checkpoint ({self.model_config.architecture}) is a cross-encoder: it "
                "scores (query, document) pairs (/v1/score, /v1/rerank, LLM.score) but does not "
                "embed; use an embedding model for /v1/embeddings"
            )
        text, token_ids = self._tokenize(prompt)
        check_embedding_input(token_ids, self.max_model_len)
        return self._queue(EncoderRequest(request_id, text, token_ids, 0))

    def add_score_request(
        self, query: str, document: str, request_id: str | None = None, truncate: bool = False
    ) -> str:
        """Queue one (query, document) pair to score, tokenized as one input of two segments
        as the cross-encoder was trained. A pair longer than max_model_len raises
        ContextLengthError unless `truncate` (then the longer text is cut first, as
        sentence-transformers' CrossEncoder does)."""
        if self.head is None:
            raise ValueError(
                f"this checkpoint ({self.model_config.architecture}) embeds; scoring pairs "
                "needs a cross-encoder (...ForSequenceClassification) or a reranker"
            )
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: scoring needs one for the pair")
        limit = {"truncation": "longest_first", "max_length": self.max_model_len}
        encoded = self.tokenizer(query, document, **(limit if truncate else {}))
        token_ids = list(encoded["input_ids"])
        types = list(encoded.get("token_type_ids") or [0] * len(token_ids))
        check_embedding_input(token_ids, self.max_model_len)
        return self._queue(EncoderRequest(request_id, None, token_ids, 0, types))

    def add_score_request_ids(self, token_ids: list[int], request_id: str | None = None) -> str:
        """Queue a pair tokenized already as `tokenizer(query, document)` tokenizes it (a job's
        score line, its ids kept on disk between the passes). The token types are rebuilt as
        BERT's tokenizer sets them, 0 through the first separator and 1 after it; a model
        whose tokenizer sets none (RoBERTa) gets zeros, as add_score_request gives it."""
        if self.head is None:
            return self.add_score_request("", "", request_id)  # raises: this model embeds
        token_ids = list(token_ids)
        check_embedding_input(token_ids, self.max_model_len)
        types = [0] * len(token_ids)
        sep = getattr(self.tokenizer, "sep_token_id", None)
        uses_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", ())
        if uses_types and sep in token_ids:
            first = token_ids.index(sep) + 1
            types[first:] = [1] * (len(token_ids) - first)
        return self._queue(EncoderRequest(request_id, None, token_ids, 0, types))

    def _queue(self, request: EncoderRequest) -> str:
        request_id = str(next(self._ids)) if request.request_id is None else request.request_id
        if request_id in self.scheduler.waiting:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = replace(request, request_id=request_id, arrival=self._num_requests)
        self.scheduler.add(request)
        self._num_requests += 1
        self._prompt_tokens += len(request.token_ids)
        return request_id

    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        """An encoder cannot generate: always raises ValueError saying so."""
        raise ValueError(
            f"this checkpoint ({self.model_config.architecture}) is an encoder: it embeds "
            "(/v1/embeddings, LLM.embed) but cannot generate; use a decoder model for "
            "completions and chat"
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.remove(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def capture_chunk_graphs(self) -> int:
        """No graphs to capture for an encoder (LLMEngine's contract: 0 when none)."""
        if self.has_unfinished():
            raise RuntimeError("capture_chunk_graphs: requests are still running; call it idle")
        return 0

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[EmbeddingOutput] | list[ScoreOutput]:
        """Run one batch; returns an EmbeddingOutput (vector on the host) for each request, or
        a ScoreOutput for each pair of a cross-encoder."""
        batch = self.scheduler.next_batch(self.max_batch_tokens, self.max_num_seqs)
        if not batch:
            return []
        self._num_steps += 1
        self._num_finished += len(batch)
        self._computed += sum(len(r) for r in batch)
        if self.head is not None:
            scores = as_scores(self._classify(batch), self.activation)
            return [ScoreOutput(r.request_id, s, r.token_ids) for r, s in zip(batch, scores)]
        vectors = self._embed(batch).cpu()
        return [
            EmbeddingOutput(r.request_id, r.prompt, r.token_ids, v)
            for r, v in zip(batch, vectors.unbind())
        ]

    @torch.inference_mode()
    def _classify(self, batch: list[EncoderRequest]) -> torch.Tensor:
        """[len(batch), num_labels] logits of a cross-encoder's head, on the device."""
        lengths = torch.tensor([len(r) for r in batch], device=self.device)
        ids = pad_sequence(
            [torch.tensor(r.token_ids, dtype=torch.long) for r in batch], batch_first=True
        ).to(self.device)
        types = pad_sequence(
            [torch.tensor(r.token_types, dtype=torch.long) for r in batch], batch_first=True
        ).to(self.device)
        return self.head(self.model(ids, lengths, types))

    @torch.inference_mode()
    def _embed(self, batch: list[EncoderRequest]) -> torch.Tensor:
        """[len(batch), hidden] float32 pooled vectors, on the device."""
        lengths = torch.tensor([len(r) for r in batch], device=self.device)
        inputs = [torch.tensor(r.token_ids, dtype=torch.long) for r in batch]
        ids = pad_sequence(inputs, batch_first=True).to(self.device)  # zeros past each length
        hidden = self.model(ids, lengths)  # [batch, longest, hidden]
        real = torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]
        rows = hidden[real]  # [sum of lengths, hidden]: each input's rows, in batch order
        chunks, first = [], 0
        for r in batch:  # each input whole, in one chunk
            self.pooler.add_request(r.request_id)
            chunks.append(PoolingChunk(r.request_id, self.pooling_config, first, 0, len(r), len(r)))
            first += len(r)
        _, vectors = self.pooler.add_step(rows, chunks)
        return vectors

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests=self._num_requests,
            num_finished=self._num_finished,
            num_steps=self._num_steps,
            prompt_tokens=self._prompt_tokens,
            computed_tokens=self._computed,
            generation_tokens=0,
            num_preemptions=0,
            prefix_queries=0,
            prefix_hits=0,
            kv_usage=0.0,
            num_kv_blocks=0,
            block_size=self.config.cache.block_size,
            weight_bytes=self.weight_bytes,
        )


def _refuse_decoder_options(config: EngineConfig) -> None:
    """Options that would change an answer or ask for a part an encoder lacks fail by name."""
    problems = []
    if config.attention_backend not in ("auto", "torch"):
        problems.append(
            f"attention_backend={config.attention_backend!r} (its kernels are causal and paged; "
            "encoders run on the torch backend's SDPA: use auto or torch)"
        )
    if config.quantization is not None:
        problems.append(f"quantization={config.quantization!r} (encoders run float weights)")
    if config.cache.kv_cache_dtype != "auto":
        problems.append(f"kv_cache_dtype={config.cache.kv_cache_dtype!r} (there is no KV cache)")
    if config.speculative is not None:
        problems.append("speculative decoding (an encoder generates nothing)")
    if problems:
        raise ValueError(
            f"{config.model} is an encoder model (embeddings only), which does not support "
            + "; ".join(problems)
        )


def _encoder_pooling(model: str, architecture: str) -> PoolingConfig:
    """The checkpoint's sentence-transformers pooling. An encoder folder without modules.json
    is refused: BERT models pool by CLS or by mean as they were trained, and a guess (the
    decoders' last token) would answer with wrong vectors."""
    if not (Path(model).expanduser() / "modules.json").is_file():
        raise ValueError(
            f"{model} ({architecture}) has no sentence-transformers modules.json, so its "
            "pooling (CLS or mean) is unknown: use the checkpoint as sentence-transformers "
            "saves it (modules.json, 1_Pooling/config.json, 2_Normalize if it normalises)"
        )
    return read_pooling_config(model)

"""The engines an embedding benchmark compares: kvbatch's LLM.embed and sentence-transformers'
`encode`, texts in, vectors out.

The generative peers (peer.py) decode token ids; these take text, because tokenizing and
batching texts by length is part of what an embedding engine does and of what it costs. Each
is driven like a generative peer, one after the other in one process:

    load() (not timed) -> embed(texts) once untimed (warm-up) -> embed(texts) (timed) -> close()

Padding is part of the cost too: `padded_tokens` says how many token rows each engine's
forward passes hold for the texts (real tokens plus padding), worked out from how it batches.
"""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from kvbatch.engine import LLM
from kvbatch.engine.encoder.batches import EncoderRequest, LengthBatcher


class Embedder(ABC):
    """One embedding engine under test."""

    name: ClassVar[str]

    def __init__(self, model_path: str, device: str = "cpu") -> None:
        self.model_path = model_path
        self.device = device

    @property
    def label(self) -> str:
        """The row name in the table."""
        return self.name

    @abstractmethod
    def load(self) -> None:
        """Load weights and tokenizer (not timed)."""

    @abstractmethod
    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), hidden] float32 vectors, in input order."""

    @abstractmethod
    def padded_tokens(self, texts: list[str], lengths: list[int]) -> int:
        """Token rows this engine's forward passes hold for `texts` (of `lengths` tokens)."""

    def close(self) -> None:
        for attr in list(vars(self)):
            if attr not in ("model_path", "device"):
                setattr(self, attr, None)
        gc.collect()


class KvbatchEmbedder(Embedder):
    """kvbatch's LLM.embed (engine/encoder/): one call for all texts, the engine's defaults
    unless `max_num_batched_tokens` / `max_num_seqs` are given."""

    name = "kvbatch"

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        super().__init__(model_path, device)
        self.engine_args = {
            k: v
            for k, v in (
                ("max_num_batched_tokens", max_num_batched_tokens),
                ("max_num_seqs", max_num_seqs),
            )
            if v is not None
        }

    def load(self) -> None:
        self.llm = LLM(model=self.model_path, device=self.device, **self.engine_args)

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.llm.embed(texts), dtype=np.float32)

    def padded_tokens(self, texts: list[str], lengths: list[int]) -> int:
        """Replays the engine's LengthBatcher on the lengths, all texts waiting at once."""
        engine = self.llm.engine
        batcher = LengthBatcher()
        for i, n in enumerate(lengths):
            batcher.add(EncoderRequest(str(i), None, [0] * n, i))
        total = 0
        while batch := batcher.next_batch(engine.max_batch_tokens, engine.max_num_seqs):
            total += len(batch) * max(len(r) for r in batch)
        return total


class SentenceTransformersEmbedder(Embedder):
    """sentence-transformers' `encode` at one batch size (its default is 32): it sorts the
    texts by character length, longest first, and pads each batch to its longest."""

    name = "sentence-transformers"

    def __init__(self, model_path: str, device: str = "cpu", batch_size: int = 32) -> None:
        super().__init__(model_path, device)
        self.batch_size = batch_size

    @property
    def label(self) -> str:
        return f"st batch {self.batch_size}"

    def load(self) -> None:
        from sentence_transformers import SentenceTransformer  # optional: the test extra

        self.model = SentenceTransformer(self.model_path, device=self.device)

    def embed(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(texts, batch_size=self.batch_size, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def padded_tokens(self, texts: list[str], lengths: list[int]) -> int:
        order = np.argsort([-len(t) for t in texts])  # SentenceTransformer.encode's own sort
        total = 0
        for first in range(0, len(texts), self.batch_size):
            batch = [lengths[i] for i in order[first : first + self.batch_size]]
            total += len(batch) * max(batch)
        return total

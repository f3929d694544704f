"""The indexing pipeline a user would write today, as the peer of `kvbatch index`:
transformers `generate` over the chunks' prompts in static batches (8 by default, in chunk
order, left-padded; 1: one call per chunk), sentence-transformers `encode` over the chunks,
LanceDB `add` of the rows.

It is given what kvbatch is given (the corpus folder, the same models, the same context
prompt and token budget) and reads, parses and chunks with kvbatch's own parser and chunker,
so both sides hold the same chunk texts and send the same prompts: what differs is how the
prompts are generated (each prompt prefilling its whole document again), embedded and written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvbatch.index.chunking import Chunker
from kvbatch.index.embed_budget import EmbeddingBudget
from kvbatch.index.parse import parse_document
from kvbatch.index.prompts import CONTEXT_PROMPT


@dataclass
class UserRun:
    """What the user's pipeline wrote and what it cost."""

    rows: int = 0
    prompt_tokens: int = 0  # every prompt prefilled in full: no sharing
    padded_prompt_tokens: int = 0  # what the batches prefilled, left padding included
    output_tokens: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # load, chunk, generate, embed, write


@dataclass(frozen=True)
class UserPipeline:
    generation_model: str | None  # None: no context stage
    embedding_model: str
    chunk_size: int
    chunk_overlap: int = 0
    context_max_tokens: int = 100
    prompt: str = CONTEXT_PROMPT
    device: str = "cpu"
    encode_batch_size: int = 32
    generate_batch_size: int = 8
    source: str = ""  # the index spec's source name: chunk ids are of it (compared by id)

    def run(self, corpus: Path, uri: str, table: str = "chunks") -> UserRun:
        run = UserRun()
        clock = _Clock(run.seconds)
        with clock("load"):
            embedder = SentenceTransformer(self.embedding_model, device=self.device)
            chunker = Chunker.for_tokenizer(embedder.tokenizer, self.chunk_size, self.chunk_overlap)
            if self.generation_model is not None:
                tokenizer = AutoTokenizer.from_pretrained(self.generation_model)
                model = AutoModelForCausalLM.from_pretrained(
                    self.generation_model, dtype=torch.float32
                ).to(self.device)
        rows = []
        with clock("chunk"):
            for path in sorted(p for p in corpus.rglob("*") if p.is_file()):
                doc_id = path.relative_to(corpus).as_posix()
                text = parse_document(doc_id, path.read_bytes())
                for chunk in chunker.chunk(doc_id, text, self.source):
                    rows.append({"chunk_id": chunk.chunk_id, "document_id": doc_id,
                                 "text": chunk.text, "document": text})  # fmt: skip
        with clock("generate"):
            documents = [row.pop("document") for row in rows]
            if self.generation_model is None:
                for row in rows:
                    row["context"] = None
            else:
                prompts = [
                    self.prompt.format(document=document, chunk=row["text"])
                    for row, document in zip(rows, documents)
                ]
                size = self.generate_batch_size
                for first in range(0, len(rows), size):
                    contexts = self._generate(model, tokenizer, prompts[first : first + size], run)
                    for row, context in zip(rows[first : first + size], contexts):
                        row["context"] = context
        with clock("embed"):
            # the same inputs kvbatch embeds (a context cut to fit, never the chunk), so the
            # vectors compare; sentence-transformers alone would cut the chunk's end instead
            budget = EmbeddingBudget(embedder.tokenizer, embedder.max_seq_length)
            texts = [budget.input_for(r["text"], r["context"]) for r in rows]
            vectors = embedder.encode(texts, batch_size=self.encode_batch_size)
            for row, vector in zip(rows, np.asarray(vectors, dtype=np.float32)):
                row["embedding"] = vector.tolist()
        with clock("write"):
            db = lancedb.connect(uri)
            dim = len(rows[0]["embedding"]) if rows else 0
            schema = pa.schema(
                [
                    pa.field("chunk_id", pa.string()),
                    pa.field("document_id", pa.string()),
                    pa.field("text", pa.string()),
                    pa.field("context", pa.string()),
                    pa.field("embedding", pa.list_(pa.float32(), dim)),
                ]
            )
            db.create_table(table, schema=schema).add(rows)
        run.rows = len(rows)
        return run

    def _generate(self, model, tokenizer, prompts: list[str], run: UserRun) -> list[str]:
        """One static batch: chat-templated, left-padded, greedy."""
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in prompts
        ]
        tokenizer.padding_side = "left"
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(
            self.device
        )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                max_new_tokens=self.context_max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        width = inputs["input_ids"].shape[1]
        run.prompt_tokens += int(inputs["attention_mask"].sum())
        run.padded_prompt_tokens += int(inputs["input_ids"].numel())
        contexts = []
        for row in out[:, width:]:
            run.output_tokens += int((row != pad).sum())
            contexts.append(tokenizer.decode(row, skip_special_tokens=True).strip())
        return contexts


class _Clock:
    """`with clock("stage"):` adds the block's wall seconds to seconds["stage"]."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    def __call__(self, stage: str) -> _Clock:
        self.stage = stage
        return self

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.start
        self.seconds[self.stage] = self.seconds.get(self.stage, 0.0) + elapsed

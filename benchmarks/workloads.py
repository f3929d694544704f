"""Benchmark workloads: each is data (a shape and a seed), never a code path of its own.

A RAG-shaped prompt is three parts, drawn from a seeded generator so that every engine sees
the same token ids:

    [ document (shared by the document's chunks) | chunk (unique) | instruction (shared by all) ]

The instruction comes last, so the only prefix two prompts share is their document: a prefix
cache can skip the document for all but the first chunk of each document. With `shared=False`
every prompt is unique random tokens of the same length, so caching cannot help at all (the
`no-share` row of docs/BENCHMARKS.md: it shows there is no regression where caching is useless).

Prompts come document by document (document 0's chunks, then document 1's, ...), in the
order a job would hand them to the engine after prefix grouping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

FIRST_ORDINARY_TOKEN = 3
"""Token ids below this are special (unk/pad, bos, eos in Llama-family vocabularies)."""

SMOLLM2 = "smollm2-135m-instruct"
"""Real SmolLM2-135M-Instruct weights (engine.fetch.smollm2_dir()), for CPU workloads."""

LLAMA_1B_RANDOM = "llama-3.2-1b-random"
"""Llama-3.2-1B shape with random weights, for the GPU workloads (`rag`, `long-prefill`): a
later issue builds that model and registers those workloads."""


@dataclass(frozen=True)
class Workload:
    """One benchmark job: `num_documents x chunks_per_document` requests of equal length.

    `model` names which weights the workload runs on (one of the constants above); `dtype` and
    `device` are what the row of docs/BENCHMARKS.md measured, and the CLI may override them.
    """

    name: str
    model: str
    num_documents: int
    chunks_per_document: int
    document_len: int
    chunk_len: int
    instruction_len: int
    output_len: int
    shared: bool = True
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    description: str = ""

    def __post_init__(self) -> None:
        counts = ("num_documents", "chunks_per_document", "output_len")
        lengths = ("document_len", "chunk_len", "instruction_len")
        for field in counts:
            if getattr(self, field) < 1:
                raise ValueError(f"workload {self.name!r}: {field} must be >= 1")
        for field in lengths:
            if getattr(self, field) < 0:
                raise ValueError(f"workload {self.name!r}: {field} must be >= 0")
        if self.prompt_len < 1:
            raise ValueError(f"workload {self.name!r}: prompts would be empty")

    @property
    def num_requests(self) -> int:
        return self.num_documents * self.chunks_per_document

    @property
    def prompt_len(self) -> int:
        return self.document_len + self.chunk_len + self.instruction_len

    @property
    def output_tokens(self) -> int:
        """Output tokens of the whole job (every request decodes exactly `output_len`)."""
        return self.num_requests * self.output_len

    def with_seed(self, seed: int) -> Workload:
        """The same shape with other token ids (e.g. one draw per repeat of a benchmark)."""
        return dataclasses.replace(self, seed=seed)

    def summary(self) -> str:
        """One line for the top of a results table."""
        kind = "shared documents" if self.shared else "no shared prefix"
        return (
            f"{self.name}: {self.num_requests} requests = {self.num_documents} documents x "
            f"{self.chunks_per_document} chunks, prompt {self.prompt_len} = "
            f"{self.document_len} + {self.chunk_len} + {self.instruction_len} tokens "
            f"({kind}), output {self.output_len} tokens, model {self.model}, {self.dtype}"
        )

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = dataclasses.asdict(self)
        d.update(
            num_requests=self.num_requests,
            prompt_len=self.prompt_len,
            output_tokens=self.output_tokens,
        )
        return d


def make_prompts(workload: Workload, vocab_size: int) -> list[list[int]]:
    """The workload's prompts as token ids in [3, vocab_size), the same for the same seed."""
    if vocab_size <= FIRST_ORDINARY_TOKEN + 1:
        raise ValueError(f"vocab_size must be > {FIRST_ORDINARY_TOKEN + 1}, got {vocab_size}")
    rng = np.random.default_rng(workload.seed)

    def draw(n: int) -> list[int]:
        return rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n).tolist()

    if not workload.shared:
        return [draw(workload.prompt_len) for _ in range(workload.num_requests)]

    instruction = draw(workload.instruction_len)
    prompts = []
    for _ in range(workload.num_documents):
        document = draw(workload.document_len)
        for _ in range(workload.chunks_per_document):
            prompts.append(document + draw(workload.chunk_len) + instruction)
    return prompts


_RAG_CPU = Workload(
    name="rag-cpu",
    model=SMOLLM2,
    num_documents=4,
    chunks_per_document=8,
    document_len=384,
    chunk_len=64,
    instruction_len=16,
    output_len=32,
    description="prefix reuse and batch throughput on the CPU",
)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        _RAG_CPU,
        dataclasses.replace(
            _RAG_CPU,
            name="no-share",
            shared=False,
            description="unique prompts of rag-cpu's shape: no regression where caching is useless",
        ),
    )
}
"""Registry by name. The GPU rows (`rag`, `long-prefill`) are added by a later issue."""


def get_workload(name: str) -> Workload:
    """The registered workload `name`; the error lists the known ones."""
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise ValueError(f"unknown workload {name!r}; known: {known}") from None

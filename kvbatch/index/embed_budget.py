"""What fits in one input of the embedding model: the chunk, and as much of its context as
the model's input limit leaves.

A chunk of `chunking.size` tokens fits only if the model's limit leaves room for it and the
special tokens its tokenizer adds ([CLS] and [SEP] for BERT): all-MiniLM-L6-v2 takes 256
tokens in all, so a 256-token chunk would be refused. The chunker is given the room there is.
The context sentence goes before the chunk (contextual embeddings); where the two together are
too long, the context is cut from its end, never the chunk, which is what the row holds and
what a search must find. The row keeps the whole context.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("kvbatch.index")

SEPARATOR = "\n\n"


@dataclass
class EmbeddingBudget:
    """`limit`: the longest input the embedding model takes, special tokens included."""

    tokenizer: object
    limit: int

    @property
    def special_tokens(self) -> int:
        return len(self.tokenizer("")["input_ids"])

    @property
    def chunk_tokens(self) -> int:
        """The longest chunk that fits alone."""
        return self.limit - self.special_tokens

    def chunk_size(self, asked: int) -> int:
        """`chunking.size`, or less when the model takes less (said once in the log)."""
        if asked <= self.chunk_tokens:
            return asked
        log.warning(
            "chunking.size %d is more than the embedding model takes (%d tokens with its %d "
            "special ones): chunks of at most %d tokens",
            asked, self.limit, self.special_tokens, self.chunk_tokens,
        )  # fmt: skip
        return self.chunk_tokens

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def input_for(self, text: str, context: str | None) -> str:
        """The embedding input: `context`, a blank line, `text`; the context cut from its end
        to fit the limit, or left out where the chunk alone fills it."""
        if not context:
            return text
        joined = f"{context}{SEPARATOR}{text}"
        if self._count(joined) <= self.limit:
            return joined
        ids = self.tokenizer.encode(context, add_special_tokens=False)
        keep = self.limit - self._count(f"{SEPARATOR}{text}")
        while keep > 0:
            cut = self.tokenizer.decode(ids[:keep], skip_special_tokens=True).strip()
            joined = f"{cut}{SEPARATOR}{text}"
            if cut and self._count(joined) <= self.limit:
                return joined
            keep -= 1 if keep < 8 else keep // 8  # a round trip may add a token or two
        return text

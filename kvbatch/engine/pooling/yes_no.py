"""Decoder rerankers (Qwen3-Reranker and the like): a causal LM asked whether a document
answers a query, scored by how much more it wants to say "yes" than "no".

The checkpoint's chat template renders the pair as one prompt, from two messages with the
roles `query` and `document` (sentence-transformers' convention for CrossEncoder on a causal
LM; Qwen3-Reranker's template writes its fixed instruction around them and ends with the
assistant's turn opened). The prompt is prefilled like an embedding request, pooled at its last
token without normalising, and projected on the two vocabulary rows:

    score = sigmoid(logit["yes"] - logit["no"])       = softmax([no, yes])[yes]

which is sentence-transformers' LogitScore followed by CrossEncoder's sigmoid, and the number
vLLM's /score answers for the same model. The query sits before the document in the prompt, so
all the pairs of one query share a prefix and the prefix cache computes it once (last-token
pooling takes prefix hits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import: job validation reads this module (kvbatch status)
    import torch

from kvbatch.engine.pooling.config import PoolingConfig, PoolingMethod

LAST_STATE = PoolingConfig(PoolingMethod.LAST, normalize=False)
"""The pooling of a reranker's prompt: the last token's final state, as it is."""

_PROBE = ("\x00query\x00", "\x00document\x00")


@dataclass(frozen=True)
class YesNoReranker:
    """How a causal LM scores a pair: its chat template and its yes and no token ids."""

    yes_token_id: int
    no_token_id: int

    @classmethod
    def of(cls, tokenizer, model: str) -> YesNoReranker:
        """The reranker reading of `tokenizer`'s model; ValueError naming what it lacks."""
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{model} has no chat template: a decoder reranker's template renders the "
                "(query, document) pair (Qwen3-Reranker's, with the roles query and document)"
            )
        rendered = _render(tokenizer, *_PROBE)
        if not all(marker in rendered for marker in _PROBE):
            raise ValueError(
                f"the chat template of {model} cannot carry a (query, document) pair: it must "
                "render a message of role 'query' and one of role 'document', as rerankers' "
                "templates do; this looks like a chat model, not a reranker"
            )
        if _renders_any_message(tokenizer):
            raise ValueError(
                f"the chat template of {model} renders every message whatever its role, as a "
                "chat model's does: a reranker's template picks the 'query' and 'document' "
                "messages into its fixed prompt; this looks like a chat model, not a reranker"
            )
        ids = [_single_token(tokenizer, word, model) for word in ("yes", "no")]
        return cls(*ids)

    def prompt_token_ids(self, tokenizer, query: str, document: str) -> list[int]:
        return list(
            tokenizer(_render(tokenizer, query, document), add_special_tokens=False)["input_ids"]
        )

    def scores(
        self, states: torch.Tensor | Sequence[torch.Tensor], output_embedding: torch.Tensor
    ) -> list[float]:
        """states: [n, hidden] last-token states (or n [hidden] ones); output_embedding:
        [vocab, hidden]. sigmoid(logit yes - logit no) per state."""
        rows = output_embedding[[self.yes_token_id, self.no_token_id]].float()  # [2, hidden]
        out = []
        for state in states:  # a [n, hidden] tensor iterates by row
            yes, no = (state.to(rows.device).float() @ rows.T).tolist()
            out.append(_sigmoid(yes - no))
        return out


def _sigmoid(x: float) -> float:
    """1 / (1 + e^-x) without overflow for either sign."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _render(tokenizer, query: str, document: str) -> str:
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _renders_any_message(tokenizer) -> bool:
    """Whether the template writes out a message of a role it does not know (a chat model's
    template writes every message; a reranker's selects its two roles, so an extra message
    leaves no trace). A template that refuses the extra message is a chat template too."""
    extra = "\x00other\x00"
    messages = [
        {"role": "query", "content": _PROBE[0]},
        {"role": "document", "content": _PROBE[1]},
        {"role": extra, "content": extra},
    ]
    try:
        return extra in tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # jinja's TemplateError, raise_exception(...) of a strict chat template
        return True


def _single_token(tokenizer, word: str, model: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(word)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer of {model} has no token {word!r}, which a reranker needs")
    return int(token_id)

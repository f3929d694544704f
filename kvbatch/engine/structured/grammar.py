"""JSON-schema grammars compiled by xgrammar, once per distinct schema, and their matchers.

xgrammar (arXiv 2411.15100; vLLM's and SGLang's default) compiles a schema against the
tokenizer's vocabulary into a pushdown automaton whose per-state token masks are mostly
precomputed, so filling one sequence's next-token bitmask costs microseconds. Compiling is
the slow part (milliseconds to seconds for a large schema), so compiled grammars are cached by
the schema's canonical text: a batch job that sends one schema on every line compiles it once.

Generated JSON is compact but readable, with Python's separators (", " and ": ") and no
other whitespace: free whitespace lets a small model loop on newlines until max_tokens.
Strict mode (OpenAI's `strict: true`): objects take no properties beyond those declared
unless the schema allows them.

Tokens holding a raw control byte (0x00-0x1f) are never allowed: compact JSON has no place
for one (whitespace is only the separators' spaces; inside strings they must be escaped), and
xgrammar's rule for strings with a maxLength lets them through, which gives text that
json.loads refuses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr
from torch import Tensor

from kvbatch.engine.structured.params import StructuredOutputs

SEPARATORS = (", ", ": ")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarMatcher:
    """One sequence's position in its grammar (a kvbatch.engine.structured.constraint
    TokenConstraint)."""

    def __init__(
        self, compiled: xgr.CompiledGrammar, allowed: Tensor, batch: xgr.BatchGrammarMatcher
    ) -> None:
        """`allowed` [W] int32: tokens the output may ever hold (GrammarCompiler.allowed);
        `batch`: the compiler's thread pool that fills many matchers' rows at once."""
        self._matcher = xgr.GrammarMatcher(compiled)
        self._allowed = allowed
        self._batch = batch

    @staticmethod
    def fill_bitmasks(constraints: Sequence[GrammarMatcher], bitmask: Tensor) -> None:
        """Row i of `bitmask` for `constraints[i]`, filled by xgrammar's threads in one call
        (matchers of one compiler), then the allowed-token mask over all rows at once."""
        first = constraints[0]
        first._batch.batch_fill_next_token_bitmask([c._matcher for c in constraints], bitmask)
        bitmask.bitwise_and_(first._allowed)

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row].bitwise_and_(self._allowed)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles StructuredOutputs against one tokenizer, keeping the last `max_cached`
    distinct grammars (least recently used goes first)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_cached: int = 256,
    ) -> None:
        """`vocab_size`: the model's logits width (it may exceed the tokenizer's vocabulary:
        the padding ids are never allowed). `stop_token_ids`: what ends a completed JSON."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.allowed = _without_control_bytes(info.decoded_vocab, vocab_size, stop_token_ids)
        self._batch = xgr.BatchGrammarMatcher()  # threads: half the host's cores
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.max_cached = max_cached
        self.num_compiled = 0  # compilations so far (cache misses)

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; raises ValueError, saying why, for a schema that
        xgrammar cannot compile (an unsupported keyword, a dangling $ref, ...)."""
        key = spec.key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        schema = JSON_OBJECT_SCHEMA if spec.json_object else spec.json_schema
        try:
            compiled = self._compiler.compile_json_schema(
                schema,
                any_whitespace=False,
                separators=SEPARATORS,
                strict_mode=not spec.json_object,
            )
        except Exception as e:  # xgrammar raises RuntimeError, ValueError and its own types
            raise ValueError(
                f"the JSON schema cannot be compiled into a grammar ({type(e).__name__}: {e}): "
                "fix the schema or drop the keywords named"
            ) from None
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar."""
        return GrammarMatcher(self.compile(spec), self.allowed, self._batch)


def _without_control_bytes(
    decoded_vocab: Sequence[bytes], vocab_size: int, keep: Sequence[int]
) -> Tensor:
    """[ceil(V / 32)] int32 bitmask of the tokens without a byte below 0x20 (`keep` always
    allowed: the stop tokens' text, if any, is not output)."""
    ok = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    for token, text in enumerate(decoded_vocab[:vocab_size]):
        ok[token] = not text or min(text) >= 0x20
    ok[list(keep)] = True
    bits = np.packbits(ok.reshape(-1, 8), axis=1, bitorder="little")  # [V / 8, 1] uint8
    return torch.from_numpy(bits.reshape(-1).view(np.int32).copy())

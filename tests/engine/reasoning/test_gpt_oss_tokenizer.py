"""A gpt-oss tokenizer (o200k_harmony) built offline by transformers' tiktoken converter
(tests/harmony_tokenizer.py): it encodes as openai-harmony does, it names its parser, and its
pieces give back the published o200k_base file."""

from __future__ import annotations

import hashlib

import pytest

from kvbatch.engine.reasoning.harmony_vocab import (
    O200K_BASE_SHA256,
    harmony_encoding,
    o200k_base_from_tokenizer,
)
from kvbatch.engine.reasoning.registry import choose_reasoning_parser, detect_reasoning_parser

pytestmark = pytest.mark.slow  # the conversion merges 200k tokens: about 15 s of CPU


@pytest.fixture(scope="module")
def tokenizer(harmony_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(harmony_model)


def test_encodes_as_openai_harmony(tokenizer):
    text = (
        "<|start|>assistant<|channel|>final<|message|>Héllo wörld 12345 🤖 "
        "def f(x):\n    return x<|return|>"
    )
    assert tokenizer.encode(text, add_special_tokens=False) == harmony_encoding().encode(
        text, allowed_special="all"
    )


def test_the_model_names_its_parser(tokenizer):
    assert detect_reasoning_parser(tokenizer) == "openai_gptoss"
    assert set(choose_reasoning_parser(None, tokenizer).stop_token_ids) == {200002, 200012}
    assert choose_reasoning_parser("none", tokenizer) is None


def test_vocab_file_from_the_checkpoint_tokenizer(tokenizer):
    data = o200k_base_from_tokenizer(tokenizer)
    assert hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256


def test_schema_grammar_starts_at_the_final_message(tokenizer):
    """xgrammar's matcher for a schema, behind harmony's watcher, on a hand-written answer:
    every token allowed through the analysis message and the final header, then only what
    the schema allows, ended by <|return|>."""
    import torch

    from kvbatch.engine import StructuredOutputs
    from kvbatch.engine.structured.after_reasoning import GrammarAfterReasoning
    from kvbatch.engine.structured.bitmask import bitmask_words
    from kvbatch.engine.structured.grammar import GrammarCompiler

    parser = choose_reasoning_parser(None, tokenizer)
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, parser.stop_token_ids)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = GrammarAfterReasoning(
        compiler.matcher(StructuredOutputs(json_schema=schema)), parser.reasoning_end([])
    )
    encode = harmony_encoding().encode
    thinking = encode(
        "<|channel|>analysis<|message|>Count: one.<|end|><|start|>assistant"
        "<|channel|>final<|message|>",
        allowed_special="all",
    )
    answer = encode('{"n": 1}', allowed_special="all") + [200002]
    mask = torch.empty((1, bitmask_words(vocab)), dtype=torch.int32)

    def allowed(token: int) -> bool:
        GrammarAfterReasoning.fill_bitmasks([grammar], mask)
        return bool((mask[0, token // 32] >> (token % 32)) & 1)

    hello = encode("Hello")[0]
    for token in thinking:
        assert allowed(token) and allowed(hello)
        assert grammar.accept(token)
    assert not allowed(hello)  # the answer must be the schema's JSON now
    for token in answer:
        assert allowed(token)
        assert grammar.accept(token)
    assert grammar.is_terminated()

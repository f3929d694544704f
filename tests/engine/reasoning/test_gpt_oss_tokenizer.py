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
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.harmony_tokenizer import build_harmony_tokenizer

    return AutoTokenizer.from_pretrained(build_harmony_tokenizer(tmp_path_factory.mktemp("oss")))


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

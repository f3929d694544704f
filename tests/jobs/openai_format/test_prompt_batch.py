"""Prompts encoded a chunk at a time give the ids (and the errors) of prompt_token_ids, line by
line: SmolLM2's real tokenizer and chat template, the same with a BOS its post-processor adds,
and a tokenizer whose settings keep it off the direct path."""

from __future__ import annotations

import json
import random

import pytest

from kvbatch.jobs.openai_format.prompt_batch import _direct_backend, encode_texts, prompts_token_ids
from kvbatch.jobs.openai_format.prompts import PromptError, prompt_token_ids
from kvbatch.jobs.openai_format.validate import JobRequest, validate_lines

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WORDS = "the of revenue growth é 中文 😀 tokens  spaces\tand\nnewlines <|im_end|> 123".split(" ")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def bos_tokenizer(smollm2_dir):
    """SmolLM2's tokenizer whose post-processor puts <|im_start|> first, as Llama's adds BOS."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    return tok


def _requests(n: int, seed: int = 0) -> list[JobRequest]:
    """Chat and completions lines of every kind prompt_token_ids sees: text of many scripts,
    ids given (some outside the vocabulary), empty prompts, prompts too long for 300 tokens."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 3, 40, 400])))
        kind = rng.random()
        if kind < 0.5:
            body = {"messages": [{"role": "system", "content": f"Doc {i % 7}"},
                                 {"role": "user", "content": text or "?"}]}  # fmt: skip
            url = CHAT
        elif kind < 0.85:
            body, url = {"prompt": text}, COMPLETIONS
        else:
            ids = [rng.randrange(0, 50_000) for _ in range(rng.choice([0, 5, 20]))]
            body, url = {"prompt": ids}, COMPLETIONS
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                                 "body": body}))  # fmt: skip
    reqs = [r for r in validate_lines(lines) if isinstance(r, JobRequest)]  # "" is refused there
    assert len(reqs) > 0.7 * n
    return reqs


def _one_by_one(reqs, tokenizer, max_len):
    out = []
    for r in reqs:
        try:
            out.append(prompt_token_ids(r, tokenizer, max_len))
        except PromptError as e:
            out.append((e.code, e.message))
    return out


def _as_compared(results):
    return [(r.code, r.message) if isinstance(r, PromptError) else list(r) for r in results]


@pytest.mark.parametrize("which", ["tokenizer", "bos_tokenizer"])
def test_a_chunk_gives_the_ids_and_errors_of_one_line_at_a_time(which, request):
    tok = request.getfixturevalue(which)
    assert _direct_backend(tok) is not None  # the Rust tokenizer, called directly
    reqs = _requests(300)
    expected = _one_by_one(reqs, tok, 300)
    assert _as_compared(prompts_token_ids(reqs, tok, 300)) == expected
    codes = {e[0] for e in expected if isinstance(e, tuple)}
    assert codes == {"invalid_prompt", "context_length_exceeded"}  # both kinds were met
    if which == "bos_tokenizer":  # completions text got the post-processor's first token
        texts = [e for r, e in zip(reqs, expected) if isinstance(r.prompt, str)]
        bos = tok.convert_tokens_to_ids("<|im_start|>")
        assert all(e[0] == bos for e in texts if isinstance(e, list))


def test_a_tokenizer_with_truncation_set_is_encoded_as_its_encode_does(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tok.backend_tokenizer.enable_truncation(max_length=8)  # encode() turns this off
    assert _direct_backend(tok) is None
    reqs = _requests(40, seed=1)
    assert _as_compared(prompts_token_ids(reqs, tok, 300)) == _one_by_one(reqs, tok, 300)


def test_a_text_that_cannot_be_encoded_fails_alone(tokenizer):
    texts = ["hello world", "lone \ud800 surrogate", "more text"]
    encoded = encode_texts(tokenizer, texts, add_special_tokens=False)
    assert encoded[0] == tokenizer.encode(texts[0], add_special_tokens=False)
    assert isinstance(encoded[1], Exception)
    assert encoded[2] == tokenizer.encode(texts[2], add_special_tokens=False)

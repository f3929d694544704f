"""Prompts: the model's own chat template, completions as is, and the context limit."""

from __future__ import annotations

import json

import pytest

from kvbatch.jobs.openai_format.prompts import (
    PromptError,
    max_tokens_for,
    prompt_token_ids,
    sampling_params_for,
)
from kvbatch.jobs.openai_format.validate import JobRequest, validate_lines

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def request(url: str = CHAT, default_max_tokens: int | None = None, **body) -> JobRequest:
    raw = json.dumps({"custom_id": "r", "method": "POST", "url": url, "body": body})
    [req] = validate_lines([raw], default_max_tokens=default_max_tokens)
    assert isinstance(req, JobRequest), req
    return req


def test_chat_goes_through_the_models_template(tokenizer):
    messages = [
        {"role": "developer", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Capital of"},
                {"type": "text", "text": "France?"},
            ],
        },
    ]
    ids = prompt_token_ids(request(messages=messages), tokenizer, 2048)
    expected_messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of\nFrance?"},
    ]
    # The template's text already holds the special tokens: encoding it without adding any
    # gives exactly what the template's own tokenization gives.
    expected = tokenizer.apply_chat_template(
        expected_messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids == list(expected)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_without_system_gets_the_templates_default(tokenizer):
    ids = prompt_token_ids(request(messages=[{"role": "user", "content": "Hi"}]), tokenizer, 2048)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)


def test_completions_take_the_text_as_is(tokenizer):
    text = "The quick brown fox"
    assert prompt_token_ids(request(COMPLETIONS, prompt=text), tokenizer, 2048) == tokenizer.encode(
        text
    )
    assert prompt_token_ids(request(COMPLETIONS, prompt=[5, 6, 7]), tokenizer, 2048) == [5, 6, 7]


def test_token_ids_outside_the_vocabulary(tokenizer):
    with pytest.raises(PromptError, match=r"token id 99999 is outside") as info:
        prompt_token_ids(request(COMPLETIONS, prompt=[1, 99999]), tokenizer, 2048)
    assert info.value.code == "invalid_prompt"


def test_prompt_longer_than_the_model_allows(tokenizer):
    req = request(COMPLETIONS, prompt="word " * 50)
    n = len(tokenizer.encode("word " * 50))
    assert len(prompt_token_ids(req, tokenizer, n + 1)) == n  # room for one output token
    with pytest.raises(PromptError) as info:
        prompt_token_ids(req, tokenizer, n)
    err = info.value
    assert err.code == "context_length_exceeded"
    assert f"{n} tokens" in err.message and f"--max-model-len {n}" in err.message
    assert "shorten the prompt" in err.message
    record = err.line_error(req)
    assert (record.line, record.custom_id, record.code) == (1, "r", "context_length_exceeded")
    assert record.message.startswith("line 1: the prompt has")


class BrokenTemplate:
    """A tokenizer whose chat template raises, as templates that reject a role do."""

    def apply_chat_template(self, *args, **kwargs):
        from jinja2.exceptions import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant")


def test_template_failure_is_invalid_prompt():
    req = request(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(PromptError, match="must alternate") as info:
        prompt_token_ids(req, BrokenTemplate(), 2048)
    assert info.value.code == "invalid_prompt"


def test_max_tokens_for():
    # A cap the line sets must fit, like OpenAI and vLLM ...
    explicit = request(messages=[{"role": "user", "content": "x"}], max_tokens=100)
    assert max_tokens_for(explicit, prompt_len=50, max_model_len=150) == 100
    with pytest.raises(PromptError, match="lower max_tokens to 99 or less") as info:
        max_tokens_for(explicit, prompt_len=51, max_model_len=150)
    assert info.value.code == "context_length_exceeded"
    # ... a default one is clamped to the room left.
    chat = request(messages=[{"role": "user", "content": "x"}])
    assert max_tokens_for(chat, prompt_len=50, max_model_len=150) == 100
    chat_default = request(default_max_tokens=20, messages=[{"role": "user", "content": "x"}])
    assert max_tokens_for(chat_default, prompt_len=50, max_model_len=150) == 20
    assert max_tokens_for(chat_default, prompt_len=140, max_model_len=150) == 10
    completion = request(COMPLETIONS, prompt="x")
    assert max_tokens_for(completion, prompt_len=145, max_model_len=150) == 5
    with pytest.raises(PromptError):
        max_tokens_for(completion, prompt_len=150, max_model_len=150)
    params = sampling_params_for(chat, prompt_len=50, max_model_len=150)
    assert params.max_tokens == 100 and params.temperature == chat.params.temperature

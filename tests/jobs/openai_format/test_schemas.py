"""Request bodies: strict types, OpenAI defaults, the mapping to SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvbatch.jobs.openai_format.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CONTEXT_MAX_TOKENS,
    BatchLine,
    ChatCompletionBody,
    CompletionBody,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"messages": USER, **fields})


def completion(**fields) -> CompletionBody:
    return CompletionBody.model_validate({"prompt": "hi", **fields})


def error_types(cls, body: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return {str(e["loc"][0]) if e["loc"] else "": e["type"] for e in info.value.errors()}


def test_batch_line_fields():
    line = BatchLine.model_validate(
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
    )
    assert line.url == "/v1/completions"
    bad = error_types(BatchLine, {"custom_id": "x" * 513, "method": "post", "url": "/v1/x"})
    assert set(bad) == {"custom_id", "method", "url", "body"}


def test_chat_defaults_follow_openai():
    p = chat().sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert p.max_tokens == CONTEXT_MAX_TOKENS and p.logprobs is None and p.stop == ()
    assert chat().sampling_params(job_default_max_tokens=256).max_tokens == 256
    assert completion().sampling_params(job_default_max_tokens=256).max_tokens == (
        COMPLETIONS_DEFAULT_MAX_TOKENS
    )


def test_fields_map_to_sampling_params():
    p = chat(
        max_completion_tokens=7,
        temperature=0,  # an int where a number goes is fine
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        seed=42,
        stop="\n",
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
    ).sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
        7,
        0.0,
        0.9,
        0,
        0.05,
        42,
    )
    assert p.stop == ("\n",) and p.ignore_eos and p.logprobs == 3 and p.greedy
    assert chat(logprobs=True).logprobs_n() == 0
    assert chat(logprobs=False).logprobs_n() is None
    assert completion(logprobs=0).sampling_params().logprobs == 0
    assert completion(stop=[]).sampling_params().stop == ()
    assert completion(stop_token_ids=[2, 3]).sampling_params().stop_token_ids == (2, 3)


def test_top_p_zero_means_the_most_likely_token():
    p = chat(top_p=0).sampling_params()
    assert p.top_p == 1.0 and p.top_k == 1 and p.greedy


def test_max_tokens_spellings():
    assert chat(max_tokens=5).requested_max_tokens() == 5
    assert chat(max_tokens=5, max_completion_tokens=5).requested_max_tokens() == 5
    assert error_types(
        ChatCompletionBody, {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}
    ) == {"": "invalid_parameter"}
    assert "max_completion_tokens" in error_types(
        CompletionBody, {"prompt": "x", "max_completion_tokens": 5}
    )


def test_strict_types():
    bad = error_types(
        ChatCompletionBody,
        {
            "messages": USER,
            "temperature": "1.0",
            "max_tokens": True,
            "seed": 1.0,
            "top_k": 2.5,
            "logprobs": 1,
            "stop": ["a", 1],
        },
    )
    assert set(bad) == {"temperature", "max_tokens", "seed", "top_k", "logprobs", "stop"}
    assert error_types(ChatCompletionBody, {"messages": USER, "temperature": 2.5}) == {
        "temperature": "less_than_equal"
    }
    assert "stop" in error_types(ChatCompletionBody, {"messages": USER, "stop": list("abcde")})


def test_messages():
    body = ChatCompletionBody.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "ann",
                },
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    assert body.message_dicts() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": "ok"},
    ]
    for messages in (
        [],
        "hi",
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": None}],
        [{"role": "assistant", "content": "x", "tool_calls": []}],
    ):
        assert "messages" in error_types(ChatCompletionBody, {"messages": messages}), messages


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", True),
        ("stream_options", {"include_usage": True}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "x"}),
    ],
)
def test_unsupported_chat_parameters(field, value):
    assert error_types(ChatCompletionBody, {"messages": USER, field: value}) == {
        field: "unsupported_parameter"
    }


@pytest.mark.parametrize(
    ("field", "value"), [("echo", True), ("suffix", "end"), ("best_of", 3), ("prompt", ["a", "b"])]
)
def test_unsupported_completion_parameters(field, value):
    assert error_types(CompletionBody, {"prompt": "x", field: value}) == {
        field: "unsupported_parameter"
    }


def test_neutral_and_ignored_values_pass():
    chat(
        n=1,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        stream=False,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        user="u1",
        metadata={"k": "v"},
        store=True,
        service_tier="auto",
        reasoning_effort="low",
        model="any",
        stream_options=None,
    )
    completion(echo=False, suffix="", best_of=1, user="u1")


def test_prompt_forms():
    assert completion(prompt="x").prompt == "x"
    assert completion(prompt=["x"]).prompt == "x"
    assert completion(prompt=[1, 2]).prompt == [1, 2]
    assert completion(prompt=[[1, 2]]).prompt == [1, 2]
    for prompt in ("", [], [-1], [1.5], [True], {"text": "x"}, 5, [["a"]]):
        assert "prompt" in error_types(CompletionBody, {"prompt": prompt}), prompt
    assert error_types(CompletionBody, {"prompt": [[1], [2]]}) == {
        "prompt": "unsupported_parameter"
    }


def test_unknown_fields_are_rejected():
    assert error_types(ChatCompletionBody, {"messages": USER, "max_tokns": 5}) == {
        "max_tokns": "extra_forbidden"
    }
    assert error_types(CompletionBody, {"prompt": "x", "messages": USER}) == {
        "messages": "extra_forbidden"
    }

"""Structured outputs on a reasoning model: the reasoning is free, the grammar starts after
</think> (a tiny random model that reasons in <think> blocks: tests/think_model.py).

A random model never closes its reasoning on its own, so a small logit_bias on </think> makes
it close after a few dozen free tokens (greedy: the same tokens every run)."""

from __future__ import annotations

import json

import pytest

from kvbatch.engine import SamplingParams, StructuredOutputs
from kvbatch.engine.core.chat import render_chat

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
}
CONVERSATION = [{"role": "user", "content": "Where is the Eiffel tower?"}]


def params(end_id: int, bias: float = 2.0) -> SamplingParams:
    return SamplingParams(
        max_tokens=60,
        temperature=0,
        logit_bias={end_id: bias},
        structured_outputs=StructuredOutputs(json_schema=SCHEMA),
    )


@pytest.fixture(scope="module")
def llm(think_model):
    from kvbatch.engine import LLM

    return LLM(model=str(think_model), device="cpu", kv_cache_bytes=1 << 24)


def end_id(llm) -> int:
    return llm.engine.reasoning.end_id


def test_reasoning_free_then_valid_json(llm):
    assert llm.engine.reasoning.name == "qwen3"  # chosen from the tokenizer and template
    prompt = render_chat(llm.tokenizer, CONVERSATION)  # ends inside an open <think>
    out = llm.generate([prompt], params(end_id(llm)), use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    assert end_id(llm) in ids
    cut = ids.index(end_id(llm))
    assert cut >= 5  # free reasoning first
    reasoning = llm.tokenizer.decode(ids[:cut])
    assert not reasoning.lstrip().startswith("{")  # the grammar did not shape it
    answer = llm.tokenizer.decode(ids[cut + 1 :], skip_special_tokens=True)
    assert json.loads(answer).keys() == {"city"}
    assert out.finish_reason == "stop"
    split = llm.engine.reasoning.split(prompt["prompt_token_ids"], ids)
    assert split.content == answer and split.num_reasoning_tokens == cut + 1


def test_thinking_off_constrains_from_the_first_token(llm):
    prompt = render_chat(
        llm.tokenizer, CONVERSATION, chat_template_kwargs={"enable_thinking": False}
    )
    out = llm.generate([prompt], params(end_id(llm)), use_tqdm=False)[0].outputs[0]
    assert end_id(llm) not in out.token_ids
    assert json.loads(out.text).keys() == {"city"}


def test_without_a_parser_the_grammar_starts_at_once(think_model):
    """The contrast: with reasoning_parser none the schema constrains the thinking too."""
    from kvbatch.engine import LLM

    llm = LLM(model=str(think_model), device="cpu", kv_cache_bytes=1 << 24, reasoning_parser="none")
    assert llm.engine.reasoning is None
    prompt = render_chat(llm.tokenizer, CONVERSATION)
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    out = llm.generate([prompt], params(end), use_tqdm=False)[0].outputs[0]
    assert end not in out.token_ids
    assert out.text.startswith("{")


def test_batch_mixes_reasoning_and_answering_rows(llm):
    """One step's bitmask: a row still reasoning (all tokens) beside a row the grammar holds."""
    thinking = render_chat(llm.tokenizer, CONVERSATION)
    answering = render_chat(
        llm.tokenizer, CONVERSATION, chat_template_kwargs={"enable_thinking": False}
    )
    p = params(end_id(llm))
    both = llm.generate([thinking, answering], [p, p], use_tqdm=False)
    alone = [llm.generate([x], p, use_tqdm=False)[0] for x in (thinking, answering)]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]

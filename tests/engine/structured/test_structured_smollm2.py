"""Structured outputs on the real SmolLM2: every constrained answer parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.structured.params import StructuredOutputs
from tests.engine.structured.schemas import SCHEMAS

pytestmark = pytest.mark.slow

MAX_TOKENS = 160

FREE = [
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Name a famous painter.",
    "Say hello in French.",
]


def chat(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return llm.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def constrained_params(i: int, schema: dict) -> SamplingParams:
    """Greedy and seeded sampling alternate, so both paths meet the mask; every third request
    also has a frequency penalty (without it, SmolLM2's greedy population_millions writes
    7.5578427214999... until max_tokens: a grammar bounds the form of a number, not its
    digits)."""
    so = StructuredOutputs(json_schema=schema)
    penalty = 1.0 if i % 3 == 1 else 0.0
    if i % 2:
        return SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=i,
            frequency_penalty=penalty,
            structured_outputs=so,
        )
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, frequency_penalty=penalty, structured_outputs=so
    )


FREE_PARAMS = [
    SamplingParams(max_tokens=24, temperature=0),
    SamplingParams(max_tokens=24, temperature=0.8, seed=3),
]


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(model=str(smollm2_dir), device="cpu", max_model_len=1024)


def prompt_for(llm: LLM, instruction: str, schema: dict) -> str:
    return chat(llm, f"{instruction} Reply with JSON following this schema: {json.dumps(schema)}")


def test_schemas_in_one_batch_with_free_requests(llm) -> None:
    assert len(SCHEMAS) >= 20
    free_prompts = [chat(llm, t) for t in FREE]
    free_params = [FREE_PARAMS[i % 2] for i in range(len(FREE))]
    alone = llm.generate(free_prompts, free_params, use_tqdm=False)

    prompts = [prompt_for(llm, text, schema) for text, schema in SCHEMAS]
    params = [constrained_params(i, schema) for i, (_, schema) in enumerate(SCHEMAS)]
    # two any-JSON-object requests, and the free ones interleaved
    prompts += [chat(llm, "Describe a cat as a JSON object.")] * 2
    json_object = StructuredOutputs(json_object=True)
    params += [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=json_object),
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.7, seed=5, structured_outputs=json_object
        ),
    ]
    outs = llm.generate(prompts + free_prompts, params + free_params, use_tqdm=False)

    for (_, schema), out in zip(SCHEMAS, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    for out in outs[len(SCHEMAS) : len(SCHEMAS) + 2]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)
    # free requests: the same tokens as without constrained neighbours
    got = [o.outputs[0].token_ids for o in outs[len(prompts) :]]
    assert got == [o.outputs[0].token_ids for o in alone]
    # one grammar per distinct schema
    assert llm.engine.grammars.num_compiled == len(SCHEMAS) + 1
    llm.engine.kv.check_integrity()

"""`LLM.chat`: conversations through the model's chat template, token for token what
transformers' own `apply_chat_template` gives, and answered as `generate` answers those tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvbatch.engine import LLM, SamplingParams
from tests.jobs.qwen_tool_template import QWEN_TOOL_TEMPLATE

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a primary colour."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to three."},
    ],
]


@pytest.fixture(scope="module")
def llm(tiny_chat_model: Path) -> LLM:
    return LLM(model=str(tiny_chat_model), device="cpu", kv_cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def reference(tiny_chat_model: Path):
    """transformers' tokenizer of the same folder, loaded on its own."""
    return AutoTokenizer.from_pretrained(str(tiny_chat_model))


def _template_ids(tokenizer, conversation, **kwargs) -> list[int]:
    kwargs.setdefault("add_generation_prompt", True)
    out = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def test_prompts_are_transformers_chat_template(llm, reference):
    outputs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert len(outputs) == len(CONVERSATIONS)
    for conversation, out in zip(CONVERSATIONS, outputs):
        assert out.error is None
        assert out.prompt_token_ids == _template_ids(reference, conversation)
        assert out.prompt == reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        assert "<|im_start|>assistant\n" in out.prompt  # the generation prompt is there


def test_answers_equal_generate_on_the_template_tokens(llm, reference):
    chats = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    ids = [_template_ids(reference, c) for c in CONVERSATIONS]
    generated = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [c.outputs[0].token_ids for c in chats] == [g.outputs[0].token_ids for g in generated]


def test_one_conversation_gives_one_output(llm, reference):
    (out,) = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == _template_ids(reference, CONVERSATIONS[0])


def test_continue_final_message_and_template_kwargs(llm, reference):
    partial = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital is"}]
    (out,) = llm.chat(partial, GREEDY, use_tqdm=False, continue_final_message=True)
    expected = _template_ids(
        reference, partial, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt_token_ids == expected
    assert out.prompt.endswith("The capital is")


def test_own_template_and_a_rejected_conversation(llm):
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system messages here') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    outputs = llm.chat(CONVERSATIONS[:2], GREEDY, use_tqdm=False, chat_template=template)
    assert outputs[0].error is None
    assert outputs[0].prompt == "user: What is the capital of France?\nassistant:"
    assert "no system messages here" in outputs[1].error
    assert outputs[1].outputs[0].finish_reason == "error"


def test_tools_reach_the_template_as_transformers_passes_them(llm, reference):
    """`tools=` as vLLM's LLM.chat takes them: the prompt is transformers' template output
    with the same tools (a Qwen-style tool template)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    conversation = CONVERSATIONS[0]
    (out,) = llm.chat(
        conversation, GREEDY, use_tqdm=False, chat_template=QWEN_TOOL_TEMPLATE, tools=tools
    )
    assert out.error is None and '"name": "get_weather"' in out.prompt
    assert out.prompt_token_ids == _template_ids(
        reference, conversation, chat_template=QWEN_TOOL_TEMPLATE, tools=tools
    )


@pytest.mark.parametrize("bad", ["Hello", [], [["not a message"]], [{"content": "no role"}], 42])
def test_bad_shapes_say_what_chat_takes(llm, bad):
    with pytest.raises(ValueError, match="chat takes one conversation"):
        llm.chat(bad, GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_smollm2_answers_a_question_sensibly(smollm2_dir: Path):
    """The README's example on the real SmolLM2-135M-Instruct: a sensible answer."""
    llm = LLM(model=str(smollm2_dir), device="cpu", max_model_len=512)
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0.0),
        use_tqdm=False,
    )
    assert "Paris" in out.outputs[0].text

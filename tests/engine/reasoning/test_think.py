"""The <think> parser on a real tokenizer (SmolLM2's with the markers added), streams written
by hand, and the parser chosen for each kind of model."""

from __future__ import annotations

import pytest

from kvbatch.engine.reasoning.registry import (
    choose_reasoning_parser,
    detect_reasoning_parser,
)
from kvbatch.engine.reasoning.think import ThinkParser


@pytest.fixture(scope="module")
def tokenizer(think_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_model)


@pytest.fixture(scope="module")
def parser(tokenizer):
    return ThinkParser(tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt(tokenizer, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    return ids(tokenizer, text)


def test_prompt_opens_the_reasoning(tokenizer, parser):
    out = ids(tokenizer, "The user asks a sum.\n</think>\n\nIt is 4.")
    split = parser.split(prompt(tokenizer), out)
    assert split.reasoning == "The user asks a sum."
    assert split.content == "It is 4."
    assert split.num_reasoning_tokens == out.index(parser.end_id) + 1


def test_answer_opens_its_own_reasoning(tokenizer, parser):
    plain_prompt = ids(tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    out = ids(tokenizer, "<think>\nhmm\n</think>\n\nHello!")
    split = parser.split(plain_prompt, out)
    assert (split.reasoning, split.content) == ("hmm", "Hello!")
    no_markers = parser.split(plain_prompt, ids(tokenizer, "Hello!"))
    assert (no_markers.reasoning, no_markers.content, no_markers.num_reasoning_tokens) == (
        None,
        "Hello!",
        0,
    )


def test_an_earlier_turn_is_not_this_one(tokenizer, parser):
    """A short last user turn after an answer that closed its reasoning: the new answer is
    not thought to start after a </think> of the turn before."""
    history = ids(
        tokenizer,
        "<|im_start|>assistant\n<think>\nx\n</think>\n\nA<|im_end|>\n"
        "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n",
    )
    assert parser.opens_in_reasoning(history) is None
    assert not parser.reasoning_end(history).ended


def test_thinking_switched_off(tokenizer, parser):
    """enable_thinking=false: the template closed an empty block, the answer is content."""
    closed = prompt(tokenizer, enable_thinking=False)
    split = parser.split(closed, ids(tokenizer, "It is 4."))
    assert (split.reasoning, split.content, split.num_reasoning_tokens) == (None, "It is 4.", 0)
    assert parser.reasoning_end(closed).ended
    assert not parser.reasoning_end(prompt(tokenizer)).ended


def test_cut_inside_the_reasoning(tokenizer, parser):
    out = ids(tokenizer, "Let me think about the")
    split = parser.split(prompt(tokenizer), out)
    assert split.reasoning == "Let me think about the"
    assert split.content is None
    assert split.num_reasoning_tokens == len(out)


def test_stream_token_by_token(tokenizer, parser):
    """The watcher ends on </think> exactly; a split of every prefix agrees with it."""
    out = ids(tokenizer, 'a b c</think>{"x": 1}')
    end = parser.reasoning_end(prompt(tokenizer))
    for n, token in enumerate(out, start=1):
        end.accept(token)
        split = parser.split(prompt(tokenizer), out[:n])
        assert end.ended == (split.content is not None)
    assert split.content == '{"x": 1}'


def test_detection(tokenizer, think_model, tiny_chat_model):
    from transformers import AutoTokenizer

    assert detect_reasoning_parser(tokenizer) == "qwen3"
    smollm2 = AutoTokenizer.from_pretrained(tiny_chat_model)
    assert detect_reasoning_parser(smollm2) is None
    assert choose_reasoning_parser(None, smollm2) is None
    assert choose_reasoning_parser("none", tokenizer) is None
    assert choose_reasoning_parser("deepseek_r1", tokenizer).name == "deepseek_r1"
    with pytest.raises(ValueError, match="does not hold each as one token"):
        choose_reasoning_parser("qwen3", smollm2)
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        choose_reasoning_parser("granite", tokenizer)


def test_an_unknown_token_is_no_marker(tmp_path):
    """A word-level tokenizer reads each marker as its one unknown token: no parser."""
    from transformers import AutoTokenizer

    from tests.engine.pooling.st_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path)
    words = AutoTokenizer.from_pretrained(tmp_path)
    assert len(words.encode("<|channel|>", add_special_tokens=False)) == 1  # the unknown one
    words.chat_template = "{{ '</think>' }}"
    assert detect_reasoning_parser(words) is None

"""The real SmolLM2-135M-Instruct weights: same greedy text as transformers, stop handling."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from tests.reference import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), device="cpu", kv_cache_bytes=512 << 20)


def chat_ids(llm, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text)


def test_greedy_chat_matches_transformers(llm, smollm2_dir):
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    expected = hf_greedy(smollm2_dir, prompts, 32, ignore_eos=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text
    # The shared default system prompt is served from the prefix cache.
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_text_prompts_and_stop_strings(llm):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    full = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0]
    text = full.outputs[0].text
    assert "4" in text, text
    stop = text[text.index("4") : text.index("4") + 2]  # e.g. "4,"
    cut = llm.generate(
        prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop, "zzz"]), use_tqdm=False
    )[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == full.outputs[0].token_ids[: len(cut.token_ids)]
    short = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == full.outputs[0].token_ids[:3]
    assert short.outputs[0].finish_reason == "length"


def test_eos_ends_the_answer_and_is_not_in_the_text(llm):
    out = llm.generate(
        chat_ids(llm, "Say hi."), SamplingParams(max_tokens=64, temperature=0), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in llm.engine.stop_checker.eos
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_gguf_loads_the_same_weights_as_the_converted_folder(smollm2_gguf, smollm2_dir):
    from_gguf = load_model(smollm2_gguf, torch.float32, torch.device("cpu"))
    from_dir = load_model(smollm2_dir, torch.float32, torch.device("cpu"))
    assert from_gguf.config == from_dir.config
    a, b = from_gguf.model.state_dict(), from_dir.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=name)
    assert from_gguf.tokenizer.encode("Hello world") == from_dir.tokenizer.encode("Hello world")
    assert from_gguf.eos_token_ids[0] == from_dir.eos_token_ids[0]

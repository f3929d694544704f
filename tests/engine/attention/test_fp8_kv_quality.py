"""How much an FP8 KV cache changes real SmolLM2-135M's predictions, against the float32 cache:
the figures docs quote, with loose floors so that a broken path (wrong scale, missing
dequantization, a misplaced byte) fails.

    perplexity      of tests/data/english_sample.txt, teacher-forced in one prefill
    mean KL         of the next-token distributions, float32 KV || fp8 KV, over the same text
    greedy prefix   output tokens equal before the first divergence (decode steps: the paged
                    decode path and the chunked prompt's cached prefix are read as FP8)

Run with -s to print the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.kv.memory import largest_step

TEXT = Path(__file__).parents[2] / "data" / "english_sample.txt"
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
]


def teacher_forced_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:  # [n - 1, vocab]
    """log p(token i + 1 | tokens <= i) for the whole text in one prefill step, on a throw-away
    cache of the engine's KV dtype (the engine's own pool and prefix cache stay untouched)."""
    engine = llm.engine
    step = largest_step(
        engine.model,
        num_tokens=len(ids),
        max_model_len=len(ids) + 1,
        max_num_seqs=len(ids),
        block_size=engine.config.cache.block_size,
        dtype=engine.kv_dtype,
        device=engine.device,
    )
    step.input_ids.copy_(torch.tensor(ids))
    logits = engine.model(
        step.input_ids, step.positions, step.kv_caches, step.meta, engine.runner.backend,
        logits_indices=step.logits_rows,
    )  # fmt: skip
    return torch.log_softmax(logits.float()[:-1], dim=-1)


def equal_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    kw = dict(device="cpu", dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20)
    return LLM(str(smollm2_dir), **kw), LLM(str(smollm2_dir), kv_cache_dtype="fp8", **kw)


def test_fp8_kv_perplexity_and_kl_on_english(engines):
    ref_llm, fp8_llm = engines
    ids = ref_llm.tokenizer(TEXT.read_text())["input_ids"]
    ref = teacher_forced_logprobs(ref_llm, ids)
    got = teacher_forced_logprobs(fp8_llm, ids)
    targets = torch.tensor(ids[1:])
    ppl_ref = ref.gather(1, targets[:, None]).mean().neg().exp().item()
    ppl_fp8 = got.gather(1, targets[:, None]).mean().neg().exp().item()
    kl = (ref.exp() * (ref - got)).sum(dim=1).mean().item()
    top1 = (ref.argmax(1) == got.argmax(1)).float().mean().item()
    print(
        f"\nSmolLM2-135M, {len(ids)} tokens: perplexity float32 KV {ppl_ref:.3f}, fp8 KV "
        f"{ppl_fp8:.3f}; mean KL {kl:.5f} nats; top-1 agreement {top1:.4f}"
    )
    assert ppl_fp8 < ppl_ref * 1.05
    assert kl < 0.02
    assert top1 > 0.9


def test_fp8_kv_greedy_tokens_follow_float32(engines):
    """Greedy runs agree until a near-tie: where they first differ, the FP8 run's token is
    one float32 itself ranks within 0.5 nats of its choice."""
    ref_llm, fp8_llm = engines
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [
        ref_llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for p in PROMPTS
    ]
    want = [o.outputs[0] for o in ref_llm.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in fp8_llm.generate(prompts, params)]
    prefixes = [equal_prefix(g, w.token_ids) for g, w in zip(got, want)]
    print(f"\ngreedy tokens equal before the first divergence (of 32): {prefixes}")
    for g, w, n in zip(got, want, prefixes):
        assert len(w.token_ids) == 32
        if n < 32:
            top = dict(w.logprobs[n].top)
            assert g[n] in top and top[g[n]] >= max(top.values()) - 0.5, (n, g[n], top)
    assert sum(prefixes) >= 0.25 * 32 * len(PROMPTS)

"""The checks every decoder family added as its own model file passes against transformers
(float32, CPU): logits of one prompt at several prefill chunk sizes, and greedy tokens through
the engine with prefix caching, chunked prefill, a pool small enough to preempt, and n-gram
speculative decoding. Prompts are longer than the tiny models' 24-token window."""

from __future__ import annotations

import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.core.spec_config import SpecConfig
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_models import SLIDING_WINDOW

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")

ENGINE_SETTINGS = {
    "cache": dict(enable_prefix_caching=True),
    "chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    # preemption: a few requests' worth of blocks, 16 tokens a step
    "tiny-pool": dict(num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=16),
    "one-table": dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64,
                      sliding_window_kv=False),
}  # fmt: skip
"""Engine settings each family's greedy tokens are checked under (keys: test ids)."""


def assert_logits_match(path, chunks=(None, 16, 7, 1), atol: float = 1e-4) -> None:
    """Every position's logits of a prompt three windows long equal transformers', whether
    the prompt is prefilled whole, in chunks, or one token at a time."""
    model = load_model(path, torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in chunks:
        ours = prefill_logits(model, ids, chunk or len(ids))
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0, msg=f"chunk={chunk}")


def copy_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that n-gram lookup finds drafts to propose."""
    motifs = random_prompts(512, (9, 13, 6), seed=21)
    return [m * (40 // len(m) + 1) for m in motifs]


def assert_ngram_spec_matches(path) -> None:
    """With n-gram speculative decoding the greedy tokens are still transformers', and drafts
    were proposed and verified (rejected drafts rolled back)."""
    prompts = copy_prompts()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # single-token lookups too: a tiny random model rarely repeats a whole bigram of its prompt
    spec = SpecConfig("ngram", num_speculative_tokens=3, ngram_min=1)
    llm = LLM(str(path), device="cpu", num_kv_blocks=96, max_model_len=256, speculative=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    assert sum(o.spec_stats.num_draft_tokens for o in outs if o.spec_stats) > 0
    llm.engine.kv.check_integrity()


def assert_triton_matches(path) -> None:
    """The triton backend's kernels (TRITON_INTERPRET=1 on the CPU) give transformers' greedy
    tokens too, window groups on."""
    prompts = random_prompts(512, (7, 30), seed=5)
    llm = LLM(
        str(path), device="cpu", dtype="float32", attention_backend="triton",
        num_kv_blocks=64, max_model_len=128,
    )  # fmt: skip
    assert llm.engine.runner.backend.name == "triton"
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)

"""kv_cache_dtype="fp8": the engine end to end with an E4M3 KV cache on the CPU.

The torch backend quantizes K/V as it writes them and dequantizes what it reads; the triton
backend (under the interpreter) does the same in its kernels and must give the torch
backend's tokens. Against the float cache the tokens stay close (a tiny random model's
near-ties may flip a late token, so agreement is measured, with a floor), and the pool holds
as many more blocks as the element is smaller.
"""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.attention.kv_scales import KVScales
from kvbatch.engine.core.config import CacheConfig
from tests.engine.core.test_llm import shared_prefix_prompts, tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
POOL_BYTES = 4 << 20


def run(path, prompts, params=GREEDY, scales: KVScales | None = None, **engine_args):
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=POOL_BYTES, **engine_args)
    if scales is not None:
        for layer in llm.engine.model.model.layers:
            layer.self_attn.kv_scales = scales
    outs = llm.generate(prompts, params)
    llm.engine.kv.check_integrity()
    return outs, llm


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of output positions where the two runs' tokens are equal before the first
    divergence (a later position after a divergence is counted as different)."""
    same = total = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
        total += len(x)
    return same / total


@pytest.fixture(scope="module")
def auto_run(tiny_models):
    outs, llm = run(tiny_models("llama-gqa"), shared_prefix_prompts(), kv_cache_dtype="auto")
    return tokens(outs), llm.stats()


def test_fp8_pool_holds_four_times_the_float32_blocks(tiny_models, auto_run):
    _, auto_stats = auto_run
    outs, llm = run(tiny_models("llama-gqa"), shared_prefix_prompts()[:1], kv_cache_dtype="fp8")
    stats = llm.stats()
    assert stats.kv_cache_dtype == "float8_e4m3fn" and auto_stats.kv_cache_dtype == "float32"
    assert stats.num_kv_blocks == 4 * auto_stats.num_kv_blocks
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.engine.runner.kv_caches)


def test_fp8_tokens_close_to_the_float_cache(tiny_models, auto_run):
    want, _ = auto_run
    outs, _ = run(tiny_models("llama-gqa"), shared_prefix_prompts(), kv_cache_dtype="fp8")
    got = tokens(outs)
    assert [len(t) for t in got] == [len(t) for t in want]
    assert agreement(got, want) >= 0.8, (got, want)
    assert all(g[0] == w[0] for g, w in zip(got, want))  # first tokens: the prompt's pass


def test_triton_backend_gives_the_torch_backends_fp8_tokens(tiny_models):
    prompts = shared_prefix_prompts()
    path = tiny_models("llama-gqa")
    want, _ = run(path, prompts, kv_cache_dtype="fp8", attention_backend="torch")
    got, _ = run(path, prompts, kv_cache_dtype="fp8", attention_backend="triton")
    assert tokens(got) == tokens(want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_layer_scales_are_used(tiny_models, auto_run, backend):
    """Scales set on each attention layer (as a loader does from a checkpoint's kv_cache_scheme)
    that keep K/V (|x| < 4 in this model) inside E4M3's range keep the tokens close; absurd ones
    (every K and V saturating) change them: the scales really are applied."""
    want, _ = auto_run
    prompts = shared_prefix_prompts()
    path = tiny_models("llama-gqa")
    kw = dict(kv_cache_dtype="fp8", attention_backend=backend)
    fine, _ = run(path, prompts, scales=KVScales(k=0.5, v=0.25), **kw)
    assert agreement(tokens(fine), want) >= 0.8
    broken, _ = run(path, prompts, scales=KVScales(k=1e-6, v=1e-6), **kw)
    assert agreement(tokens(broken), want) < 0.5


def test_scales_from_checkpoint_tensors():
    """What a loader reads for one layer: 0-d or [1] float tensors; a missing one is 1.0."""
    scales = KVScales.from_checkpoint(
        torch.tensor(0.125), torch.tensor([2.5], dtype=torch.bfloat16)
    )
    assert scales == KVScales(k=0.125, v=2.5)
    assert KVScales.from_checkpoint(None, None) == KVScales()
    with pytest.raises(ValueError, match=r"v_scale has shape \(4,\)"):
        KVScales.from_checkpoint(None, torch.ones(4))
    with pytest.raises(ValueError, match="finite and > 0"):
        KVScales.from_checkpoint(torch.tensor(-1.0), None)


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="choose auto, fp8, fp8_e4m3"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="finite and > 0"):
        KVScales(k=0.0)

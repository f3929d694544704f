"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers: the router
of each config, experts stacked at load, sparse layers where the config puts them; logits
within 1e-4 in float32 and the same greedy tokens through the engine (prefix caching, chunked
prefill, preemption), and with the triton backend, which runs the fused MoE kernel (under the
interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.layers.moe import SparseMoeBlock, route
from kvbatch.engine.model.experts_loader import split_experts
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.exec.padded_graphs import padded_graph_tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import (
    assert_greedy_matches_transformers,
    assert_logprobs_match_transformers,
    hf_greedy,
    hf_logits,
)
from tests.tiny_models import MOE_KINDS

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

# Which layers run experts: qwen3-moe lists layer 1 in mlp_only_layers, qwen2-moe has
# decoder_sparse_step 2, Mixtral's are all sparse.
SPARSE_LAYERS = {"qwen3-moe": [True, False], "mixtral": [True, True], "qwen2-moe": [False, True]}


def load(path):
    return load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_experts_sit_where_the_config_says(tiny_models, kind):
    loaded = load(tiny_models(kind))
    layers = loaded.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == SPARSE_LAYERS[kind]
    moe = loaded.config.moe
    sparse = next(layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock))
    e, i, h = moe.num_experts, moe.intermediate_size, loaded.config.hidden_size
    assert sparse.experts.gate_up_proj.shape == (e, 2 * i, h)
    assert sparse.experts.down_proj.shape == (e, h, i)
    assert moe.renormalize == (kind != "qwen2-moe")
    assert hasattr(sparse, "shared_expert") == (kind == "qwen2-moe")


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_match_transformers(tiny_models, kind):
    path = tiny_models(kind)
    model = load(path).model
    ids = random_prompts(512, (53,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (53, 16, 7, 1):  # whole prompt, block-sized, odd chunks, token by token
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"chunk={chunk}")


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True, max_num_batched_tokens=7),  # chunked prefill
        dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64),  # preemption
    ],
    ids=["chunked", "tiny-pool"],
)
def test_greedy_matches_transformers(tiny_models, kind, engine_args):
    path = tiny_models(kind)
    assert_greedy_matches_transformers(path, shared_prefix_prompts(), GREEDY, engine_args)


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen2-moe"])
def test_triton_backend_runs_the_fused_kernel_and_matches_transformers(
    tiny_models, kind, monkeypatch
):
    """On the triton backend the MoE block runs kernels/fused_moe.py (counted here); float32
    greedy tokens equal transformers'."""
    import kvbatch.kernels.fused_moe as kernel

    calls = []
    grouped_gemm = kernel._grouped_gemm
    monkeypatch.setattr(
        kernel, "_grouped_gemm", lambda *a, **kw: calls.append(1) or grouped_gemm(*a, **kw)
    )
    path = tiny_models(kind)
    prompts = random_prompts(512, (7, 30, 18), seed=5)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.runner.backend.name == "triton"
    assert calls  # the kernel ran, not the reference
    assert got == hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)


def test_logprobs_are_transformers(tiny_models):
    assert_logprobs_match_transformers(
        tiny_models("qwen3-moe"), shared_prefix_prompts()[0], num_kv_blocks=64, max_model_len=256
    )


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 3.0, 0.1]])
    probs = torch.softmax(logits, -1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, ids = route(logits.half(), 2, renormalize=True)
    assert weights.dtype == torch.float32  # the softmax is taken in float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    expected = probs.gather(1, ids)
    torch.testing.assert_close(
        weights, expected / expected.sum(-1, keepdim=True), atol=1e-3, rtol=0
    )


def mixtral_layer(num_experts: int, hidden: int = 4, inter: int = 3) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(num_experts, hidden)}
    for e in range(num_experts):
        prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
        sd[f"{prefix}.w1.weight"] = torch.randn(inter, hidden, generator=g)
        sd[f"{prefix}.w3.weight"] = torch.randn(inter, hidden, generator=g)
        sd[f"{prefix}.w2.weight"] = torch.randn(hidden, inter, generator=g)
    return sd


def stack_float_experts(state_dict: dict, num_experts: int) -> dict:
    """What the loader makes of a float checkpoint's experts (no quantization)."""
    return split_experts(state_dict, num_experts, None)[0]


def test_stacking_puts_gate_then_up_and_renames_mixtral():
    sd = mixtral_layer(3)
    original = dict(sd)
    out = stack_float_experts(sd, 3)
    assert sd == {}  # taken out as stacked
    assert sorted(out) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.gate.weight",
    ]
    gate_up, down = (
        out["model.layers.0.mlp.experts.gate_up_proj"],
        out["model.layers.0.mlp.experts.down_proj"],
    )
    assert gate_up.shape == (3, 6, 4) and down.shape == (3, 4, 3)
    prefix = "model.layers.0.block_sparse_moe.experts.2"
    assert torch.equal(gate_up[2, :3], original[f"{prefix}.w1.weight"])
    assert torch.equal(gate_up[2, 3:], original[f"{prefix}.w3.weight"])
    assert torch.equal(down[2], original[f"{prefix}.w2.weight"])
    assert stack_float_experts(dict(out), 3).keys() == out.keys()  # stacked ones pass through


def test_a_missing_expert_is_named():
    sd = mixtral_layer(3)
    del sd["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(
        ValueError, match="missing 1 expert weights: model.layers.0.mlp expert 1 up"
    ):
        stack_float_experts(sd, 3)


def test_padded_decode_graph_path_runs_the_experts(tiny_models, monkeypatch):
    """The static-buffer path of CUDA graphs, run eagerly (on the CPU under the interpreter):
    padding rows go through the router and the fused kernel beside the real ones and change
    none of the real rows' tokens."""
    path = tiny_models("qwen3-moe")
    prompts = random_prompts(512, (5, 19, 2), seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    assert padded_graph_tokens(path, prompts, params, monkeypatch) == want


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_cuda_graphs_and_the_kernel_on_cuda_match_transformers(tiny_models, kind):
    """On CUDA (float32): decode steps replayed from CUDA graphs with MoE layers give
    transformers' greedy tokens, as eager steps do."""
    path = tiny_models(kind)
    prompts = shared_prefix_prompts()
    want = hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)
    args = dict(device="cuda", dtype="float32", max_model_len=256)
    eager = LLM(str(path), cuda_graphs=False, **args)
    assert tokens(eager.generate(prompts, GREEDY, use_tqdm=False)) == want
    llm = LLM(str(path), **args)
    graphs = llm.engine.runner.step_graphs
    replays = []
    real_run = graphs.run
    graphs.run = lambda key, *a: replays.append(key) or real_run(key, *a)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert replays  # decode steps ran from graphs
    llm.engine.kv.check_integrity()


def test_an_expert_beyond_the_config_is_refused():
    sd = mixtral_layer(3)
    sd["model.layers.0.block_sparse_moe.experts.3.w1.weight"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="weights of expert 3, but config.json says 3 experts"):
        stack_float_experts(sd, 3)

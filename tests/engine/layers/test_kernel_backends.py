"""engine/layers/: one model definition, two kernel paths. On the triton backend the layers
run kvbatch.kernels (TRITON_INTERPRET=1 on the CPU) and give the torch path's logits, with
float and with quantized projections; q/k/v and gate/up are merged at load without renaming
the state dict; the engine's triton backend switches the layers over. Gemma is the model here
(its norms, rotary and GeGLU touch every layer kind); greedy tokens against transformers on
both backends for every architecture are in tests/engine/model/."""

from __future__ import annotations

import pytest
import torch

import kvbatch.engine.layers.activation as activation
import kvbatch.engine.layers.norm as norm
import kvbatch.engine.layers.rotary as rotary
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.layers.kernel_op import KernelOp, use_kernels
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.linear import Fp8Linear
from kvbatch.kernels.activation import gelu_tanh_and_mul_ref
from kvbatch.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kvbatch.kernels.rotary import apply_rotary_ref
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.exec.padded_graphs import padded_graph_tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy
from tests.tiny_models import SLIDING_WINDOW

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_triton_kernels_give_the_torch_logits(tiny_models, kind):
    """Every position of a prompt three windows long, whole, in chunks and token by token
    (the decode path), through the same attention backend: only the layers' kernels differ."""
    model = load_model(tiny_models(kind), torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    plain = {chunk: prefill_logits(model, ids, chunk) for chunk in (len(ids), 7)}
    use_kernels(model, "triton")
    for chunk, expected in plain.items():
        got = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(got, expected, atol=5e-5, rtol=0, msg=f"{kind} chunk={chunk}")


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_with_the_kernels_references_the_triton_path_is_the_torch_one_to_the_bit(
    tiny_models, kind, monkeypatch
):
    """The kernels' float32 sums differ from torch's in order only (the test above); with
    their torch references in their place the triton path is the torch path bit for bit:
    the residual adds, norms, rotations and GEMMs come in the same order and rounding."""
    refs = [
        (norm, "rms_norm", rms_norm_ref),
        (norm, "fused_add_rms_norm", fused_add_rms_norm_ref),
        (activation, "gelu_tanh_and_mul", gelu_tanh_and_mul_ref),
        (rotary, "apply_rotary_", apply_rotary_ref),
    ]
    for module, name, ref in refs:
        monkeypatch.setattr(module, name, ref)
    model = load_model(tiny_models(kind), torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    for chunk in (len(ids), 1):
        expected = prefill_logits(use_kernels(model, "torch"), ids, chunk)
        got = prefill_logits(use_kernels(model, "triton"), ids, chunk)
        assert torch.equal(got, expected), f"{kind} chunk={chunk}"


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_triton_path_runs_quantized_layers_on_the_kernel_gemms(tiny_models, kind):
    """Online FP8 projections stay apart (no merged weight) and run kvbatch.kernels' GEMMs;
    the logits are those of the torch path over the same quantized weights."""
    model = load_model(tiny_models(kind), torch.float32, CPU, quantization="fp8").model
    ids = random_prompts(512, (40,), seed=3)[0]
    expected = prefill_logits(model, ids, len(ids))  # torch GEMMs

    use_kernels(model, "triton")

    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, Fp8Linear) and attn.qkv_proj.weight is None
    assert attn.q_proj.backend == "triton" and mlp.gate_up_proj.weight is None
    got = prefill_logits(model, ids, len(ids))
    torch.testing.assert_close(got, expected, atol=5e-5, rtol=0)


def test_merging_at_load_keeps_the_state_dict_and_shares_the_weights(tiny_models):
    model = load_model(tiny_models("gemma3"), torch.float32, CPU).model

    state = model.state_dict()

    assert not [name for name in state if "qkv_proj" in name or "gate_up_proj" in name]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
        assert all(_storage(w) == _storage(attn.qkv_proj.weight) for w in qkv)  # views
        assert all(_storage(w) == _storage(mlp.gate_up_proj.weight) for w in gate_up)
        assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat(gate_up))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_use_kernels_refuses_an_unknown_backend(tiny_models):
    model = load_model(tiny_models("gemma2"), torch.float32, CPU).model
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        use_kernels(model, "cuda")


def test_triton_backend_runs_the_layers_triton_kernels(tiny_models, monkeypatch):
    """The engine's triton backend switches every layer to its Triton path (the norms'
    calls counted here) and gives transformers' tokens."""
    calls = []
    real = RMSNorm.forward_triton
    monkeypatch.setattr(
        RMSNorm, "forward_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    path = tiny_models("gemma2")
    prompts = random_prompts(512, (7, 30), seed=6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert calls
    ops = [m for m in llm.engine.model.modules() if isinstance(m, KernelOp)]
    assert ops and all(op.backend == "triton" for op in ops)
    assert got == hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)


def test_triton_padded_decode_graph_path_gives_transformers_tokens(tiny_models, monkeypatch):
    """The static-buffer path of CUDA graphs, run eagerly (on the CPU under the interpreter):
    padding rows go through Gemma's layers on their Triton kernels beside the real ones, with
    fresh buffers full of NaN, and change none of the real rows' tokens."""
    path = tiny_models("gemma3")
    prompts = random_prompts(512, (5, 30, 2), seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    assert padded_graph_tokens(path, prompts, params, monkeypatch) == want


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_cuda_graphs_on_cuda_match_transformers(tiny_models, kind):
    """On CUDA (float32): the Triton path in eager steps and in decode steps replayed from
    CUDA graphs gives transformers' greedy tokens."""
    path = tiny_models(kind)
    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    args = dict(device="cuda", dtype="float32", max_model_len=256)
    eager = LLM(str(path), cuda_graphs=False, **args)
    assert tokens(eager.generate(prompts, params, use_tqdm=False)) == want
    llm = LLM(str(path), **args)
    graphs = llm.engine.runner.step_graphs
    replays = []
    real_run = graphs.run
    graphs.run = lambda key, *a: replays.append(key) or real_run(key, *a)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert replays  # decode steps ran from graphs
    llm.engine.kv.check_integrity()

"""engine/model/gemma_fused.py: Gemma's fused forward (triton kernels; TRITON_INTERPRET=1 on the
CPU) gives the plain forward's logits, with float and with quantized projections, fuses the
projections without renaming the state dict, and is what the triton backend runs. Its greedy
tokens against transformers' are tests/engine/model/test_gemma.py
test_triton_backend_matches_transformers (and test_triton_backend_runs_the_fused_forward
here)."""

from __future__ import annotations

import pytest
import torch

import kvbatch.engine.model.gemma_fused as gemma_fused
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.fused import model_forward
from kvbatch.engine.model.gemma import GemmaForCausalLM
from kvbatch.engine.model.gemma_fused import gemma_fused_forward
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


class FusedModel:
    """The fused forward with the model's config beside it: what prefill_logits calls."""

    def __init__(self, model) -> None:
        self.config = model.config
        self.forward = model_forward(model, fused=True)

    def __call__(self, *args) -> torch.Tensor:
        return self.forward(*args)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_triton_fused_forward_gives_the_plain_logits(tiny_models, kind):
    """Every position of a prompt three windows long, whole, in chunks and token by token
    (the decode path), through the same attention backend: only the forward differs."""
    model = load_model(tiny_models(kind), torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    plain = {chunk: prefill_logits(model, ids, chunk) for chunk in (len(ids), 7)}
    fused = FusedModel(model)
    for chunk, expected in plain.items():
        got = prefill_logits(fused, ids, chunk)
        torch.testing.assert_close(got, expected, atol=5e-5, rtol=0, msg=f"{kind} chunk={chunk}")


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_with_the_kernels_references_the_fused_forward_is_the_plain_one_to_the_bit(
    tiny_models, kind, monkeypatch
):
    """The kernels' float32 sums differ from torch's in order only (the test above); with
    their torch references in their place the fused forward is the plain forward bit for bit:
    the residual adds, norms, rotations and GEMMs come in the same order and rounding."""
    refs = {
        "rms_norm": rms_norm_ref,
        "fused_add_rms_norm": fused_add_rms_norm_ref,
        "gelu_tanh_and_mul": gelu_tanh_and_mul_ref,
        "apply_rotary_": apply_rotary_ref,
    }
    for name, ref in refs.items():
        monkeypatch.setattr(gemma_fused, name, ref)
    model = load_model(tiny_models(kind), torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    # Fused first, so that both forwards read the same weight tensors: the CPU GEMMs round
    # differently for a weight at a loaded (unaligned) address and for its aligned copy.
    fused = FusedModel(model)
    for chunk in (len(ids), 1):
        expected = prefill_logits(model, ids, chunk)
        assert torch.equal(prefill_logits(fused, ids, chunk), expected), f"{kind} chunk={chunk}"


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_triton_fused_forward_runs_quantized_layers_on_the_kernel_gemms(tiny_models, kind):
    """Online FP8 projections stay apart (no fused weight) and run kvbatch.kernels' GEMMs;
    the logits are those of the plain forward over the same quantized weights."""
    model = load_model(tiny_models(kind), torch.float32, CPU, quantization="fp8").model
    ids = random_prompts(512, (40,), seed=3)[0]
    expected = prefill_logits(model, ids, len(ids))  # torch GEMMs

    fused = FusedModel(model)

    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Fp8Linear) and attn.qkv_weight is None
    assert attn.q_proj.backend == "triton" and model.model.layers[0].mlp.gate_up_weight is None
    got = prefill_logits(fused, ids, len(ids))
    torch.testing.assert_close(got, expected, atol=5e-5, rtol=0)


def test_triton_fusing_keeps_the_state_dict_and_shares_the_weights(tiny_models):
    model = load_model(tiny_models("gemma3"), torch.float32, CPU).model
    before = {name: t.clone() for name, t in model.state_dict().items()}

    forward = model_forward(model, fused=True)

    assert forward.func is gemma_fused_forward
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], t) for name, t in before.items())
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
        assert all(_storage(w) == _storage(attn.qkv_weight) for w in qkv)  # views, not copies
        assert all(_storage(w) == _storage(mlp.gate_up_weight) for w in gate_up)
        assert torch.equal(attn.qkv_weight, torch.cat(qkv))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_triton_backend_runs_the_fused_forward(tiny_models, monkeypatch):
    """The engine's triton backend goes through gemma_fused_forward (counted here) and gives
    transformers' tokens."""
    calls = []
    monkeypatch.setattr(
        GemmaForCausalLM,
        "fused_forward",
        lambda *a, **kw: calls.append(1) or gemma_fused_forward(*a, **kw),
    )
    path = tiny_models("gemma2")
    prompts = random_prompts(512, (7, 30), seed=6)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert calls
    assert got == hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)


def test_triton_padded_decode_graph_path_gives_transformers_tokens(tiny_models, monkeypatch):
    """The static-buffer path of CUDA graphs, run eagerly (on the CPU under the interpreter):
    padding rows go through the fused Gemma layers beside the real ones, with fresh buffers
    full of NaN, and change none of the real rows' tokens."""
    path = tiny_models("gemma3")
    prompts = random_prompts(512, (5, 30, 2), seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    assert padded_graph_tokens(path, prompts, params, monkeypatch) == want


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_cuda_graphs_on_cuda_match_transformers(tiny_models, kind):
    """On CUDA (float32): the fused forward in eager steps and in decode steps replayed from
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

"""Quantized mixture-of-experts checkpoints: experts written one projection at a time by
compressed-tensors (moe_checkpoints.py) or by the GPTQ/AWQ tools' published packers
(wna16_checkpoints.py), read by the same converters as dense layers and stacked for the fused
MoE kernel. Logits equal the reference's (compressed-tensors' own fake-quantizing forward, or
the float twin of a GPTQ/AWQ file) to float32 rounding, and greedy tokens through the engine
equal the reference's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvbatch.kernels.fused_moe as fused_moe_kernel
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.layers.moe import SparseMoeBlock
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.experts import QuantizedExperts, stack_quantized_experts
from kvbatch.engine.quant.layer_tensors import CheckpointFormatError
from kvbatch.engine.quant.linear import Fp8BlockLinear, Fp8Linear, Int8Linear, WNA16Linear
from kvbatch.engine.quant.wna16_layout import WNA16Weights, pack_rows
from kvbatch.kernels.moe_weights import Fp8BlockExperts, W8A8Experts, WNA16Experts
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.exec.padded_graphs import padded_graph_tokens
from tests.engine.model.test_model import prefill_logits
from tests.engine.quant.moe_checkpoints import build_moe_ct_checkpoint, save_float_moe
from tests.engine.quant.wna16_checkpoints import build_wna16_checkpoint
from tests.reference import hf_greedy, hf_logits

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

# (kind, scheme): every scheme on Qwen3-MoE; the other two architectures' names and routers
# (Mixtral's w1/w3/w2, Qwen2-MoE's shared expert) with one weight-only and one W8A8 scheme.
CT_CASES = [("qwen3-moe", s) for s in ("w4a16", "w4a16-asym", "w8a16", "w4a16-channel")] + [
    ("qwen3-moe", "fp8-dynamic"),
    ("qwen3-moe", "fp8-static"),
    ("qwen3-moe", "int8-w8a8"),
    ("qwen3-moe", "fp8-block"),  # Qwen3-30B-A3B-FP8's scheme
    ("mixtral", "w4a16-asym"),
    ("mixtral", "fp8-block"),
    ("mixtral", "fp8-dynamic"),
    ("qwen2-moe", "w8a16"),
    # Not int8-w8a8: transformers runs Qwen2-MoE's shared expert on [tokens, H] rows, where
    # compressed-tensors' "per token" activation scale becomes one scale for all rows.
    ("qwen2-moe", "fp8-static"),
]


def record_type(scheme: str) -> type:
    if scheme.startswith("fp8-block"):
        return Fp8BlockExperts
    return W8A8Experts if scheme.startswith(("fp8", "int8")) else WNA16Experts


def load(path):
    return load_model(path, torch.float32, CPU)


def sparse_blocks(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def reference_greedy(model, prompts, max_new_tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(seq[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize(("kind", "scheme"), CT_CASES)
def test_compressed_tensors_experts_match_the_library(moe_ct_checkpoints, kind, scheme):
    """Every expert quantized, stacked into the kernel's record, and the logits of the whole
    model equal compressed-tensors' forward of the same quantized model."""
    path, reference = moe_ct_checkpoints(kind, scheme)
    loaded = load(path)
    blocks = sparse_blocks(loaded.model)
    assert blocks
    for block in blocks:
        assert isinstance(block.experts, QuantizedExperts)
        assert type(block.experts.gate_up_proj) is record_type(scheme)
        assert type(block.gate) is torch.nn.Linear  # the router stays in float
    ids = random_prompts(512, (45,), seed=3)[0]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    ours = prefill_logits(loaded.model, ids, 45)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    if not scheme.startswith("int8"):  # int8 rounding ties may flip with another sum order
        torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("kind", "scheme"), [("qwen3-moe", "w4a16"), ("mixtral", "fp8-static")])
def test_greedy_tokens_match_the_library(moe_ct_checkpoints, kind, scheme):
    """Through the engine (paged KV, batching, prefix cache): the reference's greedy tokens."""
    path, reference = moe_ct_checkpoints(kind, scheme)
    prompts = random_prompts(512, (5, 17, 33), seed=4)
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == reference_greedy(reference, prompts, GREEDY.max_tokens)
    stats = llm.stats()
    assert stats.quantization == "compressed-tensors"


def test_quantized_experts_are_counted_at_their_size(moe_ct_checkpoints, tiny_models):
    """4-bit experts take about an eighth of float32's room: the model's weight bytes show it."""
    path, _ = moe_ct_checkpoints("qwen3-moe", "w4a16")
    quantized = load(path)
    block = sparse_blocks(quantized.model)[0]
    e, i, h = 8, 64, 64
    float_bytes = (2 * i * h + h * i) * e * 4
    expert_bytes = sum(b.numel() * b.element_size() for b in block.experts.buffers())
    assert expert_bytes < float_bytes / 5


@pytest.mark.parametrize(
    ("fmt", "bits", "act_order"),
    [("gptq", 4, True), ("gptq_v2", 8, False), ("awq", 4, False)],
)
def test_gptq_and_awq_experts_match_their_float_twin(tmp_path, fmt, bits, act_order):
    """Experts packed by the GPTQ/AWQ tools' published packers (act order shared by an
    expert's gate and up, as GPTQ gives it) against transformers running the float twin."""
    quantized, reference = build_wna16_checkpoint(fmt, bits, act_order, tmp_path, kind="qwen3-moe")
    loaded = load(quantized)
    experts = sparse_blocks(loaded.model)[0].experts
    record = experts.gate_up_proj
    assert isinstance(record, WNA16Experts) and record.bits == bits
    assert (record.g_idx is not None) == act_order
    ids = random_prompts(512, (40,), seed=5)[0]
    torch.testing.assert_close(
        prefill_logits(loaded.model, ids, 16), hf_logits(reference, ids), atol=1e-4, rtol=0
    )
    prompts = random_prompts(512, (6, 21), seed=6)
    llm = LLM(model=str(quantized), device="cpu", num_kv_blocks=64)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(reference, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_online_fp8_quantizes_float_experts(moe_ct_checkpoints, tmp_path):
    """`quantization="fp8"` on a float MoE checkpoint: the experts become FP8 per channel with
    per-token activations (the router stays float), and the model computes what
    compressed-tensors' FP8_DYNAMIC scheme makes of the same float weights."""
    path = save_float_moe("qwen3-moe", tmp_path / "float")
    _, reference = moe_ct_checkpoints("qwen3-moe", "fp8-dynamic")  # same seed, same weights
    fp8 = load_model(path, torch.float32, CPU, quantization="fp8")
    block = sparse_blocks(fp8.model)[0]
    assert isinstance(block.experts, QuantizedExperts)
    record = block.experts.gate_up_proj
    assert isinstance(record, W8A8Experts) and record.weight.dtype == torch.float8_e4m3fn
    assert type(block.gate) is torch.nn.Linear
    ids = random_prompts(512, (30,), seed=7)[0]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(fp8.model, ids, 30), ref, atol=1e-4, rtol=0)


def test_experts_half_quantized_are_refused(moe_ct_checkpoints, tmp_path):
    """A config that quantizes some of a layer's experts and not others names the layers."""
    path, _ = moe_ct_checkpoints("qwen3-moe", "w4a16")
    folder = _copy(path, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.0.mlp.experts.3.up_proj")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"some of model\.layers\.0\.mlp's experts.*3\.up_proj"):
        load(folder)


def test_an_expert_quantized_unlike_the_others_is_refused(tmp_path):
    """One expert's down_proj in 8 bits, the others' in 4 (a second group compressed-tensors
    gives it): one stacked GEMM cannot run both, and the layer is named."""
    path, _ = build_moe_ct_checkpoint(
        "qwen3-moe",
        "w4a16",
        tmp_path / "ckpt",
        more_groups={"w8a16": [r"re:.*experts\.0\.down_proj$"]},
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp.*down projections differ in bits"):
        load_model(path, torch.float32, CPU)


def test_quantized_experts_without_a_config_are_refused(moe_ct_checkpoints, tmp_path):
    path, _ = moe_ct_checkpoints("qwen3-moe", "fp8-dynamic")
    folder = _copy(path, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises((ValueError, CheckpointFormatError), match="quantiz"):
        load(folder)


def test_a_quantized_router_is_refused(tmp_path):
    """A checkpoint whose router is quantized (no writer we know does it) fails naming it."""
    quantized, _ = build_wna16_checkpoint("gptq", 4, False, tmp_path, kind="qwen3-moe")
    state = load_file(str(quantized / "model.safetensors"))
    state["model.layers.0.mlp.gate.qweight"] = torch.zeros(8, 8, dtype=torch.int32)
    save_file(state, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate is quantized"):
        load(quantized)


def _wna16_linear(k: int, n: int, g_idx: torch.Tensor | None) -> WNA16Linear:
    q = torch.randint(0, 16, (k, n), dtype=torch.int32)
    groups = k // 16
    weights = WNA16Weights(
        pack_rows(q, 4), torch.rand(groups, n) + 0.1, torch.full((groups, n), 8.0), g_idx, 16, 4
    )
    return WNA16Linear(weights, None)


def test_stacking_refuses_what_one_gemm_cannot_run():
    """Gate and up with different act orders cannot share one GEMM; experts of different
    schemes cannot share a stacked record: both fail naming the layer."""
    k, n = 32, 16
    order = torch.randperm(k).to(torch.int32) // 16

    def load_linear(e, proj):
        g = order if proj != "up" else order.flip(0)
        return _wna16_linear(k if proj != "down" else n, n if proj != "down" else k, g)

    with pytest.raises(ValueError, match="different act orders"):
        stack_quantized_experts("model.layers.0.mlp", 2, load_linear)

    def mixed(e, proj):
        if e == 1:
            w = torch.zeros(n, k, dtype=torch.int8) if proj != "down" else torch.zeros(k, n)
            return Int8Linear(w.to(torch.int8), torch.ones(w.shape[0], 1), None)
        return _wna16_linear(k if proj != "down" else n, n if proj != "down" else k, None)

    with pytest.raises(ValueError, match="mix schemes"):
        stack_quantized_experts("model.layers.0.mlp", 2, mixed)

    def static_fp8(e, proj):
        shape = (n, k) if proj != "down" else (k, n)
        scale = torch.tensor([[0.5 if proj == "gate" else 0.25]])
        w = torch.zeros(shape).to(torch.float8_e4m3fn)
        return Fp8Linear(w, torch.ones(1, 1), scale, None)

    stacked = stack_quantized_experts("model.layers.0.mlp", 2, static_fp8)
    # gate's and up's static input scales differ here: the larger is kept (nothing clips)
    assert stacked.gate_up_proj.input_scale.tolist() == [0.5, 0.5]
    assert stacked.gate_up_proj.weight_scale.shape == (2, 2 * n, 1)

    def half_static(e, proj):  # expert 1 calibrated static input scales, expert 0 dynamic
        layer = static_fp8(e, proj)
        return layer if e == 1 else Fp8Linear(layer.weight, layer.weight_scale, None, None)

    with pytest.raises(ValueError, match="mix static and dynamic activation scales"):
        stack_quantized_experts("model.layers.0.mlp", 2, half_static)


def test_block_fp8_gate_and_up_stack_only_on_whole_blocks():
    """Gate's rows must fill whole weight blocks for gate|up to share one grid of block
    scales; the stacked scales are gate's block rows, then up's."""

    def block_fp8(inter: int):
        def load_linear(e, proj):
            n, k = (inter, 64) if proj != "down" else (64, inter)
            scale = torch.full((-(-n // 32), -(-k // 32)), {"gate": 1.0, "up": 2.0}.get(proj, 3.0))
            return Fp8BlockLinear(torch.zeros(n, k).to(torch.float8_e4m3fn), scale, (32, 32), None)

        return load_linear

    stacked = stack_quantized_experts("model.layers.0.mlp", 2, block_fp8(64))
    assert isinstance(stacked.gate_up_proj, Fp8BlockExperts)
    assert stacked.gate_up_proj.weight_scale[:, :, 0].tolist() == [[1.0, 1.0, 2.0, 2.0]] * 2
    assert stacked.down_proj.weight_scale.shape == (2, 2, 2)
    with pytest.raises(ValueError, match="48 rows, not a multiple of the weight block's 32"):
        stack_quantized_experts("model.layers.0.mlp", 2, block_fp8(48))


def _copy(path, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(path, folder)
    return folder


@pytest.mark.parametrize(
    ("kind", "scheme"),
    [("qwen3-moe", "w4a16-asym"), ("qwen3-moe", "fp8-dynamic"), ("qwen3-moe", "fp8-block")],
)
def test_the_triton_kernel_runs_quantized_experts(moe_ct_checkpoints, monkeypatch, kind, scheme):
    """With the triton backend (the interpreter on the CPU) the quantized experts run in the
    fused MoE kernel, not the reference, and give the reference's greedy tokens."""
    calls = []
    for name in ("wna16_grouped_gemm", "w8a8_grouped_gemm", "fp8_block_grouped_gemm"):
        real = getattr(fused_moe_kernel, name)
        monkeypatch.setattr(
            fused_moe_kernel, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw)
        )
    path, reference = moe_ct_checkpoints(kind, scheme)
    prompts = random_prompts(512, (7, 19), seed=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert calls
    assert got == reference_greedy(reference, prompts, params.max_tokens)


def test_padded_graph_steps_run_quantized_experts_on_triton(moe_ct_checkpoints, monkeypatch):
    """The static-buffer path of CUDA graphs, run eagerly (the interpreter on the CPU):
    padding rows go through the router and the quantized experts' kernel beside the real
    ones and change none of the real rows' tokens."""
    path, reference = moe_ct_checkpoints("qwen3-moe", "int8-w8a8")
    prompts = random_prompts(512, (5, 19, 2), seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = reference_greedy(reference, prompts, params.max_tokens)
    assert padded_graph_tokens(path, prompts, params, monkeypatch) == want

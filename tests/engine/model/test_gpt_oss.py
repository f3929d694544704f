"""gpt-oss against transformers in float32: attention sinks, biased GQA attention whose
heads x head_dim is not the hidden size, alternating sliding (24 here) and full layers, YaRN
with truncate false, a biased router (softmax over the top k), biased experts with the clamped
SwiGLU, and the same model with its experts in MXFP4 (transformers reading the same files with
Mxfp4Config(dequantize=True) is the reference). Prompts are longer than the window."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvbatch.engine.attention.torch_backend as torch_backend
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.core.spec_config import SpecConfig
from kvbatch.engine.model.checkpoint_errors import CheckpointError
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.gpt_oss import GptOssForCausalLM
from kvbatch.engine.quant.mxfp4 import Mxfp4StackedExperts
from kvbatch.kernels.mxfp4 import Mxfp4Experts
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import assert_greedy_matches_transformers, hf_greedy, hf_logits
from tests.tiny_models import GPT_OSS_KINDS, SLIDING_WINDOW

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


def test_config_and_modules(tiny_models):
    loaded = load_model(tiny_models("gpt-oss"), torch.float32, CPU)
    cfg, model = loaded.config, loaded.model
    assert isinstance(model, GptOssForCausalLM)
    assert cfg.num_heads * cfg.head_dim != cfg.hidden_size  # 4 x 24 vs 64
    assert [cfg.is_sliding(i) for i in range(3)] == [True, False, True]
    assert cfg.layer_attention(0).sliding_window == SLIDING_WINDOW
    assert cfg.rope.rope_type == "yarn" and cfg.rope.scaling["truncate"] is False
    assert cfg.rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(16.0)) + 1)
    assert cfg.moe.router_bias and cfg.moe.expert_bias and cfg.moe.activation.limit == 0.6
    attn = model.model.layers[0].self_attn
    assert attn.sinks.shape == (4,) and attn.sinks.abs().max() > 0.5  # the sinks were loaded
    assert attn.o_proj.bias is not None and attn.q_proj.bias is not None


@pytest.mark.parametrize("kind", GPT_OSS_KINDS)
def test_logits_match_transformers(tiny_models, kind):
    path = tiny_models(kind)
    model = load_model(path, torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (len(ids), 16, 7, 1):
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"{kind} chunk={chunk}")


def _edit(src, dst, config_change=None, tensor_change=None):
    shutil.copytree(src, dst)
    if config_change:
        cfg = json.loads((dst / "config.json").read_text()) | config_change
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_change:
        tensors = load_file(dst / "model.safetensors")
        tensor_change(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _zero_sinks(tensors):
    for name in tensors:
        if name.endswith("self_attn.sinks"):
            tensors[name] = torch.zeros_like(tensors[name])


@pytest.mark.parametrize(
    "config_change, tensor_change",
    [
        (None, _zero_sinks),
        (dict(swiglu_limit=7.0), None),
        (dict(sliding_window=64), None),
    ],
    ids=["sinks", "swiglu-limit", "window"],
)
def test_each_feature_changes_the_logits(tiny_models, tmp_path, config_change, tensor_change):
    """Each feature is really applied: the same model with it changed gives other logits,
    still equal to transformers' for the changed checkpoint."""
    src = tiny_models("gpt-oss")
    changed = _edit(src, tmp_path / "m", config_change, tensor_change)
    ids = random_prompts(512, (40,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 40)
    b = prefill_logits(load_model(changed, torch.float32, CPU).model, ids, 40)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(changed, ids), atol=1e-4, rtol=0)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind, engine_args",
    [
        ("gpt-oss", dict(enable_prefix_caching=True)),
        ("gpt-oss-mxfp4", dict(enable_prefix_caching=True)),
        # chunked prefill (the logits test covers chunked attention in the fast tier)
        pytest.param(
            "gpt-oss", dict(enable_prefix_caching=True, max_num_batched_tokens=7), marks=SLOW
        ),
        pytest.param(
            "gpt-oss-mxfp4", dict(enable_prefix_caching=True, max_num_batched_tokens=7),
            marks=SLOW,
        ),
        # preemption under window groups
        pytest.param(
            "gpt-oss", dict(num_kv_blocks=16, max_model_len=128, max_num_batched_tokens=16),
            marks=SLOW,
        ),
    ],
    ids=["cache", "mxfp4-cache", "chunked", "mxfp4-chunked", "tiny-pool"],
)  # fmt: skip
def test_greedy_matches_transformers(tiny_models, kind, engine_args):
    path = tiny_models(kind)
    assert_greedy_matches_transformers(path, shared_prefix_prompts(), GREEDY, engine_args)


def test_cascade_decode_with_sinks_matches_transformers(tiny_models, monkeypatch):
    """Decodes sharing a prefix read it once per group; the sinks join once, in the private
    part, and the tokens are transformers'."""
    calls = []
    real = torch_backend.cascade_decode
    monkeypatch.setattr(
        torch_backend, "cascade_decode", lambda *a: calls.append(len(a[4])) or real(*a)
    )
    path = tiny_models("gpt-oss")
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [doc + torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 6, 17, 30)]
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_model_len=128)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert calls and max(calls) >= 1  # the cascade path ran
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_ngram_speculation_gives_transformers_tokens(tiny_models):
    path = tiny_models("gpt-oss")
    prompts = [p * 2 for p in random_prompts(512, (9, 14, 20), seed=6)]  # repeats to look up
    spec = SpecConfig("ngram", num_speculative_tokens=3, ngram_min=1)
    llm = LLM(str(path), device="cpu", num_kv_blocks=96, max_model_len=256, speculative=spec)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats().spec_draft_tokens > 0
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_mxfp4_experts_stay_packed(tiny_models):
    loaded = load_model(tiny_models("gpt-oss-mxfp4"), torch.float32, CPU)
    assert loaded.quantization_method == "mxfp4"
    experts = loaded.model.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4StackedExperts)
    w = experts.gate_up_proj
    assert isinstance(w, Mxfp4Experts) and w.blocks.dtype == torch.uint8
    assert (w.num_experts, w.out_features, w.in_features) == (4, 64, 64)
    float_bytes = load_model(tiny_models("gpt-oss"), torch.float32, CPU).weight_bytes
    expert_floats = 3 * 4 * (64 * 64 + 64 * 32)  # layers x experts x (gate_up + down)
    assert loaded.weight_bytes == pytest.approx(
        float_bytes - expert_floats * 4 + expert_floats * 17 // 32, abs=64
    )


def _drop(suffix):
    def change(tensors):
        del tensors[next(k for k in sorted(tensors) if k.endswith(suffix))]

    return change


def _reshape_blocks(tensors):
    name = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    tensors[name] = tensors[name][:, :, :1].contiguous()  # half the groups


def _float_experts(tensors):
    for name in [k for k in tensors if k.endswith(("_blocks", "_scales"))]:
        t = tensors.pop(name)
        if name.endswith("_blocks"):
            e, n, g, _ = t.shape
            tensors[name.removesuffix("_blocks")] = torch.zeros(e, g * 32, n)


@pytest.mark.parametrize(
    "change, message",
    [
        (_drop("layers.0.mlp.experts.gate_up_proj_scales"),
         r"has model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks but not "
         r"model\.layers\.0\.mlp\.experts\.gate_up_proj_scales"),
        (_reshape_blocks, r"model\.layers\.1\.mlp\.experts\.gate_up_proj_blocks is uint8 "
         r"\[4, 64, 1, 16\]; the model built from config.json needs uint8 \[4, 64, 2, 16\]"),
        (_float_experts, r"model\.layers\.0\.mlp\.experts\.gate_up_proj is a float tensor but "
         r"config.json's quantization_config is mxfp4"),
    ],
    ids=["missing-scales", "blocks-shape", "float-under-mxfp4"],
)  # fmt: skip
def test_broken_mxfp4_checkpoints_name_the_tensor(tiny_models, tmp_path, change, message):
    broken = _edit(tiny_models("gpt-oss-mxfp4"), tmp_path / "m", tensor_change=change)
    with pytest.raises(CheckpointError, match=message):
        load_model(broken, torch.float32, CPU)


@pytest.mark.parametrize("kind", ["gpt-oss", pytest.param("gpt-oss-mxfp4", marks=SLOW)])
def test_triton_backend_matches_transformers(tiny_models, kind):
    """The Triton kernels under the interpreter: sink attention in prefill, decode and the
    cascade split, the fused MoE with biases and the clamped SwiGLU (MXFP4: the grouped GEMM
    that reads the packed bytes)."""
    path = tiny_models(kind)
    doc = random_prompts(512, (33,), seed=8)[0]
    prompts = [doc + t for t in random_prompts(512, (2, 9), seed=9)] + random_prompts(
        512, (7,), seed=5
    )
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.runner.backend.name == "triton"
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)

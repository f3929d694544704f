"""gpt-oss's experts in the fused MoE: MXFP4 weights (kernels/mxfp4.py), per-expert biases and
the clamped SwiGLU. The reference path equals transformers' GptOssExperts over the weights
transformers' own MXFP4 dequantization gives; the Triton grouped GEMM (reading the packed
bytes) equals the reference under the interpreter."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from kvbatch.engine.models.gpt_oss import _gate_then_up
from kvbatch.kernels.fused_moe import ExpertBiases, fused_moe, fused_moe_ref
from kvbatch.kernels.moe_activation import ClampedSwiGLU
from kvbatch.kernels.mxfp4 import Mxfp4Experts, dequantize_mxfp4, quantize_mxfp4
from tests.kernels.conftest import assert_close, generator

E, H, INTER, TOP_K = 4, 64, 32, 2
ACTIVATION = ClampedSwiGLU(alpha=1.702, limit=0.8)


def gpt_oss_experts(seed: int = 0):
    """Random experts in transformers' layout (gate_up [E, H, 2I] interleaved, down [E, INTER, H]),
    packed in MXFP4 as published (out features first): (blocks and scales per projection,
    biases)."""
    g = generator(seed)
    gate_up = torch.randn(E, H, 2 * INTER, generator=g) * 0.3
    down = torch.randn(E, INTER, H, generator=g) * 0.3
    packed = {
        "gate_up": quantize_mxfp4(gate_up.transpose(1, 2)),
        "down": quantize_mxfp4(down.transpose(1, 2)),
    }
    biases = (torch.randn(E, 2 * INTER, generator=g) * 0.3, torch.randn(E, H, generator=g) * 0.3)
    return packed, biases


def routing(num_tokens: int, seed: int = 1):
    g = generator(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=g), dim=-1)
    return weights, ids


def ours(packed, biases, device, dtype):
    """The engine's form: gate_up rows de-interleaved (gate rows, then up rows), as loaded."""
    gu_blocks, gu_scales = packed["gate_up"]
    gate_up = Mxfp4Experts(
        _gate_then_up(gu_blocks, "gate_up_blocks").to(device),
        _gate_then_up(gu_scales, "gate_up_scales").to(device),
    )
    down = Mxfp4Experts(*(t.to(device) for t in packed["down"]))
    bias = ExpertBiases(
        _gate_then_up(biases[0], "gate_up_bias").to(device, dtype), biases[1].to(device, dtype)
    )
    return gate_up, down, bias


def test_reference_is_transformers_gpt_oss_experts():
    packed, biases = gpt_oss_experts()
    config = GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, swiglu_limit=ACTIVATION.limit
    )
    experts = GptOssExperts(config).eval()
    with torch.no_grad():
        experts.gate_up_proj.copy_(
            convert_moe_packed_tensors(*packed["gate_up"], dtype=torch.float32)
        )
        experts.down_proj.copy_(convert_moe_packed_tensors(*packed["down"], dtype=torch.float32))
        experts.gate_up_proj_bias.copy_(biases[0])
        experts.down_proj_bias.copy_(biases[1])
    x = torch.randn(9, H, generator=generator(5))
    weights, ids = routing(9)
    with torch.no_grad():
        want = experts(x, ids, weights)
    gate_up, down, bias = ours(packed, biases, "cpu", torch.float32)
    got = fused_moe_ref(x, gate_up, down, weights, ids, biases=bias, activation=ACTIVATION)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the clamps bit: without them the answer differs
    unclamped = fused_moe_ref(
        x, gate_up, down, weights, ids, biases=bias, activation=ClampedSwiGLU(1.702, 100.0)
    )
    assert (unclamped - want).abs().max() > 1e-2


def test_dequantization_is_transformers():
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=generator(2))
    scales = torch.randint(118, 136, (3, 8, 2), dtype=torch.uint8, generator=generator(3))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, K, N]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), theirs.transpose(1, 2))
    w = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w)), w)  # representable: unchanged


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_triton_grouped_gemm_matches_the_reference(num_tokens, dtype, device):
    packed, biases = gpt_oss_experts(seed=num_tokens)
    gate_up, down, bias = ours(packed, biases, device, dtype)
    x = (torch.randn(num_tokens, H, generator=generator(6)) * 0.5).to(device, dtype)
    weights, ids = (t.to(device) for t in routing(num_tokens, seed=7))
    kw = dict(biases=bias, activation=ACTIVATION)
    got = fused_moe(x, gate_up, down, weights, ids, **kw)
    want = fused_moe_ref(x, gate_up, down, weights, ids, **kw)
    assert_close(got, want, dtype)
    plain = fused_moe(x, gate_up, down, weights, ids)  # SiLU-and-mul, no biases
    assert (plain.float() - got.float()).abs().max() > 1e-2

"""The GPU forward: the same Llama layers as engine/model/llama.py with fused kernels and GEMMs
(Gemma's layers have their own, engine/model/gemma_fused.py, built from the same parts).

    embed -> [ norm(+add) -> qkv GEMM -> rotary (in place) -> attention -> o GEMM
               norm(+add) -> gate|up GEMM -> silu*mul -> down GEMM ] x layers -> norm -> lm head

What it changes against the plain forward, and why:
- q, k, v come from one GEMM over a [q; k; v] weight, and gate and up from one over
  [gate; up]: fewer, larger GEMMs (a decode step is launch- and bandwidth-bound). The original
  parameters become views into the fused weights, so memory is not doubled and state-dict
  names are unchanged.
- The residual add is fused into the next RMSNorm (kernels/rms_norm.py), rotary is applied in
  place from positions (kernels/rotary.py), SiLU-and-mul is one kernel (kernels/activation.py).
The arithmetic is the plain forward's (same order of the residual sums, RMSNorm in float32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvbatch.engine.model.moe import SparseMoeBlock
from kvbatch.engine.quant.linear import use_gemm_backend


def model_forward(model, fused: bool):
    """The forward a runner calls, `(input_ids, positions, kv_caches, meta, backend,
    logits_indices=None) -> logits`: the fused one (after fusing the projections) or the plain
    module. The fused forward runs quantized layers on kvbatch.kernels' GEMMs too. A model
    whose layers are not Llama's names its own as the class attribute `fused_forward`
    (Gemma: engine/model/gemma_fused.py); the rest run this file's."""
    if not fused:
        return model
    fuse_projections(model)
    use_gemm_backend(model, "triton")
    forward = getattr(type(model), "fused_forward", fused_forward)
    return functools.partial(forward, model)


def fuse_projections(model) -> None:
    """Concatenate each layer's q/k/v and gate/up weights and make the originals views.
    Quantized projections (engine/quant) stay apart: qkv_weight / gate_up_weight is None and
    the forward runs each one's own GEMM."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_weight, attn.qkv_bias = _concat(attn.q_proj, attn.k_proj, attn.v_proj)
        if not isinstance(mlp, SparseMoeBlock):  # experts are stacked already
            mlp.gate_up_weight, mlp.gate_up_bias = _concat(mlp.gate_proj, mlp.up_proj)


def _concat(*linears):
    if any(type(lin) is not torch.nn.Linear for lin in linears):
        return None, None
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears]) if has_bias else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[row : row + n]
        if has_bias:
            lin.bias.data = bias[row : row + n]
        row += n
    return weight, bias


@torch.inference_mode()
def fused_forward(
    model,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    kv_caches: list[torch.Tensor],
    meta,
    backend,
    logits_indices: torch.Tensor | None = None,
    final_hidden: list[torch.Tensor] | None = None,  # as LlamaForCausalLM.forward's
) -> torch.Tensor:  # [rows, vocab] float32
    from kvbatch.kernels.activation import silu_and_mul
    from kvbatch.kernels.fused_moe import fused_moe
    from kvbatch.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kvbatch.kernels.rotary import apply_rotary_

    cfg = model.config
    eps = cfg.rms_norm_eps
    inv_freq = model.rotary.inv_freq
    t = input_ids.shape[0]
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    residual = model.model.embed_tokens(input_ids)  # this forward's own tensor: safe in place
    pending = None  # the last sublayer's output, not yet added to the residual stream
    for layer, kv_cache in zip(model.model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        if pending is None:
            h = rms_norm(residual, layer.input_layernorm.weight, eps)
        else:
            h, residual = fused_add_rms_norm(pending, residual, layer.input_layernorm.weight, eps)
        if attn.qkv_weight is not None:
            qkv = F.linear(h, attn.qkv_weight, attn.qkv_bias)  # [T, q + 2 kv]
        else:
            qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
        q = qkv[:, :q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = attn.norm_heads(q, k)  # Qwen3's per-head q/k RMSNorm; others unchanged
        rotate_(apply_rotary_, q, k, positions, inv_freq, model.rotary.attention_factor)
        out = backend.forward(q, k, v, kv_cache, meta, attn.kv_scales, attn.variant)
        pending = attn.o_proj(out.reshape(t, q_size))
        h, residual = fused_add_rms_norm(
            pending, residual, layer.post_attention_layernorm.weight, eps
        )
        if isinstance(mlp, SparseMoeBlock):
            pending = mlp(h, experts_fn=fused_moe)  # router, then the fused experts kernel
        else:
            if mlp.gate_up_weight is not None:
                gate_up = F.linear(h, mlp.gate_up_weight, mlp.gate_up_bias)  # [T, 2 ffn]
            else:  # quantized gate and up projections run their own GEMMs
                gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)
            ffn = cfg.intermediate_size
            pending = mlp.down_proj(silu_and_mul(gate_up[:, :ffn], gate_up[:, ffn:]))
    residual += pending
    if final_hidden is not None:
        final_hidden.append(rms_norm(residual, model.model.norm.weight, eps))
    if logits_indices is not None:
        residual = residual[logits_indices]
    x = rms_norm(residual, model.model.norm.weight, eps)
    return F.linear(x, model.output_embedding).float()


def rotate_(apply_rotary_, q, k, positions, inv_freq, attention_factor: float) -> None:
    """RoPE in place (the kernel `apply_rotary_`) on the rotated dimensions (all of them, or
    the first ones with a partial rotary factor), times LongRoPE's attention factor (which the
    plain forward puts on cos and sin)."""
    rot = 2 * inv_freq.shape[0]
    if rot < q.shape[-1]:
        q, k = q[..., :rot], k[..., :rot]
    apply_rotary_(q, k, positions, inv_freq)
    if attention_factor != 1.0:
        q.mul_(attention_factor)
        k.mul_(attention_factor)

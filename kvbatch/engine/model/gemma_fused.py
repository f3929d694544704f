"""The GPU forward of Gemma 2 / Gemma 3 (engine/model/gemma.py) with fused kernels and GEMMs.

Gemma norms each sublayer's output before adding it to the residual stream, so the add that
fuses into an RMSNorm kernel is the one feeding the NEXT pre-norm, not the post-norm itself:

    plain (gemma.py)                         fused (this file)
    a = attn(input_norm(x))                  h, x = add_norm(p, x, input_norm)   (p: last MLP's)
    x = x + post_attn_norm(a)                a = attn(h)
                                             p = post_attn_norm(a)               (norm alone)
    m = mlp(pre_ffn_norm(x))                 h, x = add_norm(p, x, pre_ffn_norm)
    x = x + post_ffn_norm(m)                 p = post_ffn_norm(mlp(h))           (norm alone)

`add_norm(p, x, norm)` is `x += p; return norm(x), x` in one kernel (kernels/rms_norm.py),
the sum rounded to x's dtype as `x + p` is: the residual stream holds the same numbers as the
plain forward's. The first layer's input norm has nothing to add, and after the last layer the
pending post-FFN output is added before the final norm.

Besides: q/k/v and gate/up run as one GEMM each over concatenated weights (the originals views
into them: engine/model/fused.py fuse_projections); every norm is the (1 + w) kernel
(`unit_offset`), Gemma 3's per-head q/k norms included; rotary runs in place with the local
layers' own inverse frequencies; GELU(tanh)-and-mul is one kernel (kernels/activation.py).
Query scaling (query_pre_attn_scalar), sliding windows and Gemma 2's attention soft-cap reach
the attention backend as each layer's LayerAttention, as in the plain forward; the final
soft-cap is the same torch expression.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvbatch.engine.model.fused import rotate_
from kvbatch.kernels.activation import gelu_tanh_and_mul
from kvbatch.kernels.rms_norm import fused_add_rms_norm, rms_norm
from kvbatch.kernels.rotary import apply_rotary_


@torch.inference_mode()
def gemma_fused_forward(
    model,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    kv_caches: list[torch.Tensor],
    meta,
    backend,
    logits_indices: torch.Tensor | None = None,
    final_hidden: list[torch.Tensor] | None = None,  # as GemmaForCausalLM.forward's
) -> torch.Tensor:  # [rows, vocab] float32
    """GemmaForCausalLM.forward's logits, after engine/model/fused.py fuse_projections."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    residual = model.model.embed_tokens(input_ids)
    # sqrt(hidden) rounded to the activations' dtype first, as the plain forward multiplies
    residual = residual * torch.tensor(math.sqrt(cfg.hidden_size), dtype=residual.dtype)
    pending = None  # the last sublayer's normed output, not yet added to the residual stream
    for layer, kv_cache in zip(model.model.layers, kv_caches):
        if pending is None:
            h = rms_norm(residual, layer.input_layernorm.weight, eps, unit_offset=True)
        else:
            h, residual = fused_add_rms_norm(
                pending, residual, layer.input_layernorm.weight, eps, unit_offset=True
            )
        out = _attention(model, layer.self_attn, h, positions, kv_cache, meta, backend)
        pending = rms_norm(
            out, layer.post_attention_layernorm.weight, eps, out=out, unit_offset=True
        )
        h, residual = fused_add_rms_norm(
            pending, residual, layer.pre_feedforward_layernorm.weight, eps, unit_offset=True
        )
        out = _geglu(layer.mlp, h, cfg.intermediate_size)
        pending = rms_norm(
            out, layer.post_feedforward_layernorm.weight, eps, out=out, unit_offset=True
        )
    residual += pending
    norm_weight = model.model.norm.weight
    if final_hidden is not None:
        final_hidden.append(rms_norm(residual, norm_weight, eps, unit_offset=True))
    if logits_indices is not None:
        residual = residual[logits_indices]
    x = rms_norm(residual, norm_weight, eps, unit_offset=True)
    logits = F.linear(x, model.output_embedding).float()
    cap = cfg.gemma.final_logit_softcap
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _attention(model, attn, h, positions, kv_cache, meta, backend) -> torch.Tensor:
    """o_proj(attention(q, k, v)) of one layer: [T, hidden]."""
    t = h.shape[0]
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if attn.qkv_weight is not None:
        qkv = F.linear(h, attn.qkv_weight)  # [T, q + 2 kv]
    else:  # quantized q/k/v projections run their own GEMMs
        qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
    q = qkv[:, :q_size].view(t, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(t, kv_heads, head_dim)
    if hasattr(attn, "q_norm"):  # Gemma 3: every head's q and k normed alone, into new tensors
        q = _norm_heads(q, attn.q_norm)
        k = _norm_heads(k, attn.k_norm)
    rotary = model.local_rotary if attn.is_sliding else model.rotary
    rotate_(apply_rotary_, q, k, positions, rotary.inv_freq, rotary.attention_factor)
    out = backend.forward(q, k, v, kv_cache, meta, attn.kv_scales, attn.variant)
    return attn.o_proj(out.reshape(t, q_size))


def _norm_heads(x: torch.Tensor, norm) -> torch.Tensor:
    """The (1 + w) RMSNorm of each head of x [T, heads, head_dim], one kernel row per head."""
    t, heads, head_dim = x.shape
    rows = x.reshape(t * heads, head_dim)  # a copy where x is a strided slice of qkv
    return rms_norm(rows, norm.weight, norm.eps, unit_offset=True).view(t, heads, head_dim)


def _geglu(mlp, h: torch.Tensor, ffn: int) -> torch.Tensor:
    """down(gelu_tanh(gate(h)) * up(h)): [T, hidden]."""
    if mlp.gate_up_weight is not None:
        gate_up = F.linear(h, mlp.gate_up_weight)  # [T, 2 ffn]
    else:  # quantized gate and up projections run their own GEMMs
        gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)
    return mlp.down_proj(gelu_tanh_and_mul(gate_up[:, :ffn], gate_up[:, ffn:]))

"""Gemma 4 (text): Gemma 3's sandwich-normed layer with per-layer inputs, layers of two
shapes, and layers that read another layer's KV cache. transformers' modeling_gemma4.py is
the reference; per layer:

    x = x + post_attn_norm(attention(input_norm(x)))
    h = mlp(pre_ffn_norm(x))                                  GeGLU (gelu_tanh)
    [MoE block: h = post_ffn_norm_1(h) + post_ffn_norm_2(experts(pre_ffn_norm_2(x)))
                with the router reading x through its own unweighted norm and scales]
    x = x + post_ffn_norm(h)
    [per-layer input: x = x + post_pli_norm(proj(gelu_tanh(gate(x)) * per_layer_input))]
    x = x * layer_scalar

- RMSNorm multiplies by w, not (1 + w) as Gemma 2/3 (w is stored around one); v's norm and
  the router's have no weight at all;
- attention has no 1/sqrt(d) scale (scale 1: q and k are normed per head, v too);
- sliding layers and full layers differ in head_dim and KV heads (`per_layer_config`, from
  `global_head_dim` / `num_global_key_value_heads`), so their caches differ in shape
  (engine/kv/layer_tensors.py); each type has its RoPE, the full layers' "proportional" one
  turning only the first quarter of the pairs;
- with `attention_k_eq_v`, the full layers have no v_proj: V is the raw K projection (before
  k_norm and RoPE), then v-normed;
- the last `num_kv_shared_layers` layers compute no K and V: each reads the cache of the last
  earlier layer of its type (ModelConfig.kv_owner), so it owns no KV and the planner gives it
  no block. In a step the owner's new K/V are handed on and written again to the same slots
  (the same values: the backends' write-then-attend call stays as it is);
  `use_double_wide_mlp` doubles those layers' MLP;
- per-layer inputs: a second embedding table [vocab_per_layer, layers x P] (times sqrt(P))
  and a projection of the main embeddings (times hidden^-0.5, RMS-normed) are averaged (times
  2^-0.5) into one P-vector per layer and token;
- embeddings times sqrt(hidden); final logits soft-capped when `final_logit_softcapping`.

The MoE block's experts run a plain torch loop (the fused kernel runs SwiGLU only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvbatch.engine.attention.layer_spec import LayerAttention
from kvbatch.engine.attention.metadata import (
    UNIT_KV_SCALES,
    AttentionMetadata,
    GroupedAttention,
    KVScales,
    per_layer,
)
from kvbatch.engine.layers.linear import MergedLinear
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.model.rope import RopeConfig, rope_config_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma4Config:
    """What Gemma 4 adds to ModelConfig (whose head_dim and num_kv_heads are the sliding
    layers')."""

    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    owners: tuple[int, ...]  # the layer whose KV each layer reads (itself unless shared)
    k_eq_v: bool  # full layers: V is the K projection
    local_rope: RopeConfig
    global_rope: RopeConfig
    per_layer_input_size: int  # P; 0: no per-layer inputs
    per_layer_vocab_size: int
    double_wide_mlp: bool
    num_experts: int  # 0: no MoE block
    top_k_experts: int
    moe_intermediate_size: int
    final_logit_softcap: float | None

    @classmethod
    def from_hf(cls, hf_config, fields: dict) -> Gemma4Config:
        num_layers = fields["num_layers"]
        types = tuple(hf_config.layer_types)
        mode = getattr(hf_config, "use_bidirectional_attention", None)
        if mode == "all":
            raise ValueError(
                "Gemma4ForCausalLM checkpoint uses use_bidirectional_attention='all' "
                "(every token sees every other), which is not supported: kvbatch decodes "
                "causally"
            )
        layers = [hf_config.per_layer_config[i] for i in range(num_layers)]
        head_dims = tuple(int(c.head_dim) for c in layers)
        kv_heads = tuple(int(c.num_key_value_heads) for c in layers)
        params = hf_config.rope_parameters
        local_dim = next((d for d, t in zip(head_dims, types) if t == SLIDING), head_dims[0])
        global_dim = next((d for d, t in zip(head_dims, types) if t == FULL), head_dims[-1])
        experts = bool(getattr(hf_config, "enable_moe_block", False))
        return cls(
            layer_types=types,
            head_dims=head_dims,
            kv_heads=kv_heads,
            owners=kv_owners(types, int(hf_config.num_kv_shared_layers or 0)),
            k_eq_v=bool(getattr(hf_config, "attention_k_eq_v", False)),
            local_rope=rope_config_from_hf(hf_config, local_dim, params.get(SLIDING)),
            global_rope=rope_config_from_hf(hf_config, global_dim, params.get(FULL)),
            per_layer_input_size=int(hf_config.hidden_size_per_layer_input or 0),
            per_layer_vocab_size=int(hf_config.vocab_size_per_layer_input or 0),
            double_wide_mlp=bool(getattr(hf_config, "use_double_wide_mlp", False)),
            num_experts=int(hf_config.num_experts or 0) if experts else 0,
            top_k_experts=int(hf_config.top_k_experts or 0) if experts else 0,
            moe_intermediate_size=int(hf_config.moe_intermediate_size or 0) if experts else 0,
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        )

    def kv_shape(self, layer: int) -> tuple[int, int]:
        return self.kv_heads[layer], self.head_dims[layer]

    def kv_owner(self, layer: int) -> int:
        return self.owners[layer]

    def is_shared(self, layer: int) -> bool:
        return self.owners[layer] != layer


def kv_owners(layer_types: tuple[str, ...], num_shared: int) -> tuple[int, ...]:
    """Layer i's KV owner: i, or for the last `num_shared` layers the last earlier layer of
    their type before them (transformers' kv_sharing_modes "reuse" / "store")."""
    first_shared = len(layer_types) - num_shared
    if num_shared and first_shared <= 0:
        raise ValueError(
            f"num_kv_shared_layers ({num_shared}) leaves no layer computing K and V for the "
            f"{len(layer_types)} layers to share"
        )
    owners = list(range(len(layer_types)))
    for i in range(first_shared, len(layer_types)):
        earlier = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not earlier:
            raise ValueError(
                f"Gemma 4 layer {i} ({layer_types[i]}) shares the KV of an earlier layer of "
                "its type, and there is none: check layer_types and num_kv_shared_layers"
            )
        owners[i] = earlier[-1]
    return tuple(owners)


class Gemma4RMSNorm(RMSNorm):
    """x / rms(x) times w (not 1 + w), in float32, then cast; transformers' pow(ms, -0.5)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (x32 * self.weight.float()).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm without a weight (v's, the router's)."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4Attention(nn.Module):
    """q (and, unless KV-shared, k and v) projected and normed per head, rotated, attended at
    scale 1. A KV-shared layer is given its owner's K and V of the step."""

    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        g: Gemma4Config = cfg.family
        self.num_heads, self.head_dim = cfg.num_heads, g.head_dims[layer]
        self.num_kv_heads = g.kv_heads[layer]
        self.eps = cfg.rms_norm_eps
        self.shared = g.is_shared(layer)
        window = cfg.sliding_window if g.layer_types[layer] == SLIDING else None
        self.variant = LayerAttention(sliding_window=window, scale=1.0)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        self.q_norm = Gemma4RMSNorm(self.head_dim, self.eps)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.k_is_v = g.k_eq_v and g.layer_types[layer] == FULL
        self.kv_scales: KVScales = UNIT_KV_SCALES  # an FP8 cache's, set by the loader
        if self.shared:
            return
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.k_norm = Gemma4RMSNorm(self.head_dim, self.eps)
        if self.k_is_v:
            self.qkv_proj = MergedLinear("q_proj", "k_proj")
        else:
            self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
            self.qkv_proj = MergedLinear("q_proj", "k_proj", "v_proj")

    def forward(self, x, rotation, kv_cache, meta, backend, shared_kv=None):
        """(output [T, hidden], (k, v, scales) written to the cache: a sharer's input)."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.shared:
            q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
            # a rotation turns q and k together: a one-head scratch k (the Triton kernel
            # wants at least one head of each)
            q, _ = rotation(q, q[:, :1].clone())
            k, v, scales = shared_kv
        else:
            qkv = self.qkv_proj(x)
            q = self.q_norm(qkv[:, :q_size].view(t, self.num_heads, self.head_dim))
            k_raw = qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if self.k_is_v else qkv[:, q_size + kv_size :].view(k_raw.shape)
            v = unweighted_rms_norm(v_raw, self.eps)
            q, k = rotation(q, self.k_norm(k_raw))
            scales = self.kv_scales
        out = backend.forward(q, k, v, kv_cache, meta, scales, self.variant)
        return self.o_proj(out.reshape(t, q_size)), (k, v, scales)


class Gemma4Router(nn.Module):
    """Top-k experts per token from the residual stream (unweighted norm, times `scale` and
    hidden^-0.5), softmax in float32, renormalised, times each chosen expert's scale."""

    def __init__(self, cfg) -> None:
        super().__init__()
        g: Gemma4Config = cfg.family
        self.eps, self.top_k = cfg.rms_norm_eps, g.top_k_experts
        self.root_size = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, g.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(g.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = unweighted_rms_norm(x, self.eps) * self.scale * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """Every expert's GeGLU weights stacked (transformers 5's names and layout)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        g: Gemma4Config = cfg.family
        e, h, i = g.num_experts, cfg.hidden_size, g.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == expert)
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        g: Gemma4Config = cfg.family
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.is_sliding = g.layer_types[layer] == SLIDING
        self.self_attn = Gemma4Attention(cfg, layer)
        wide = 2 if g.double_wide_mlp and g.is_shared(layer) else 1
        self.mlp = GatedMLP(hidden, cfg.intermediate_size * wide, "gelu_tanh")
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", Gemma4RMSNorm(hidden, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer_input_size = g.per_layer_input_size
        if g.per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(hidden, g.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(g.per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.has_experts = bool(g.num_experts)
        if self.has_experts:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(cfg)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)

    def forward(self, x, per_layer_input, rotation, kv_cache, meta, backend, shared_kv):
        attn, kv = self.self_attn(
            self.input_layernorm(x), rotation, kv_cache, meta, backend, shared_kv
        )
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.has_experts:
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_size:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh")
            h = self.per_layer_projection(gate * per_layer_input)
            x = x + self.post_per_layer_input_norm(h)
        return x * self.layer_scalar, kv


class Gemma4Backbone(nn.Module):
    """`model.*` of a Gemma 4 checkpoint (the language model's, in a multimodal one)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        g: Gemma4Config = cfg.family
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if g.per_layer_input_size:
            width = cfg.num_layers * g.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(g.per_layer_vocab_size, width)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(g.per_layer_input_size, cfg.rms_norm_eps)


class Gemma4ForCausalLM(nn.Module):
    """Gemma 4 text models; the same call as LlamaForCausalLM's."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.config = cfg
        g: Gemma4Config = cfg.family
        self.model = Gemma4Backbone(cfg)
        self.rotary = RotaryEmbedding(g.global_rope)
        self.local_rotary = RotaryEmbedding(g.local_rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_embedding(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def rebuild_rotary(self, device) -> None:
        self.rotary.rebuild(device)
        self.local_rotary.rebuild(device)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: the token's per-layer embedding and the projected main embedding
        x (already times sqrt(hidden)), averaged as transformers' project_per_layer_inputs."""
        m, g = self.model, self.config.family
        shape = (x.shape[0], self.config.num_layers, g.per_layer_input_size)
        scale = torch.tensor(math.sqrt(g.per_layer_input_size), dtype=x.dtype)
        token = (m.embed_tokens_per_layer(input_ids) * scale).reshape(shape)
        projected = m.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        projected = m.per_layer_projection_norm(projected.reshape(shape))
        return (projected + token) * 2.0**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | GroupedAttention,
        backend,
        logits_indices: torch.Tensor | None = None,
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [len(logits_indices) or T, vocab] float32
        cfg, g = self.config, self.config.family
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(math.sqrt(cfg.hidden_size), dtype=x.dtype)
        inputs = self.per_layer_inputs(input_ids, x) if g.per_layer_input_size else None
        global_rotation = self.rotary(positions, x.dtype)
        local_rotation = self.local_rotary(positions, x.dtype)
        step_kv: dict[int, tuple] = {}  # each owner layer's K/V of this step, for its sharers
        layers = self.model.layers
        for i, (layer, kv_cache, layer_meta) in enumerate(
            zip(layers, kv_caches, per_layer(meta, len(layers)))
        ):
            rotation = local_rotation if layer.is_sliding else global_rotation
            pli = inputs[:, i] if inputs is not None else None
            shared = step_kv.get(g.owners[i]) if g.is_shared(i) else None
            x, step_kv[i] = layer(x, pli, rotation, kv_cache, layer_meta, backend, shared)
        if final_hidden is not None:
            final_hidden.append(self.model.norm(x))
        if logits_indices is not None:
            x = x[logits_indices]
        logits = F.linear(self.model.norm(x), self.output_embedding)
        cap = g.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


SHARED_LAYER_TENSORS = ("k_proj", "v_proj", "k_norm", "v_norm")


def drop_shared_layers_kv(state_dict: dict, cfg) -> dict:
    """A checkpoint may carry K/V projections for its KV-shared layers, which never run them
    (transformers ignores them on load too): left out."""
    g: Gemma4Config = cfg.family
    prefixes = tuple(
        f"model.layers.{i}.self_attn.{name}."
        for i in range(cfg.num_layers)
        if g.is_shared(i)
        for name in SHARED_LAYER_TENSORS
    )
    if not prefixes:
        return state_dict
    return {k: v for k, v in state_dict.items() if not k.startswith(prefixes)}


register_architecture(
    Architecture(
        "Gemma4ForCausalLM",
        "gemma4_text",
        Gemma4ForCausalLM,
        activations=("gelu_pytorch_tanh", "gelu_tanh"),
        activation_key="hidden_activation",
        adapt_checkpoint=drop_shared_layers_kv,
        read_family_config=Gemma4Config.from_hf,
        per_layer_shapes=True,
    )
)

"""gpt-oss (OpenAI's open-weight MoE models, 20b and 120b): Llama's pre-norm transformer with

- attention with biases on q, k, v and o, GQA, head_dim x heads != hidden (64 x 64 vs 2,880),
  and a learned sink logit per head in the softmax's denominator (engine/attention/layer_spec:
  it takes no value, so a head may attend to nothing);
- layers alternating sliding-window (128) and full attention (`layer_types`), served by the
  window KV groups as Gemma's and Mistral's are;
- YaRN RoPE whose attention factor multiplies cos and sin (engine/model/rope.py; gpt-oss's
  config sets truncate false);
- a mixture of experts in every layer: a router with a bias, softmax over the top k logits,
  experts with biases and a clamped SwiGLU (kernels/moe_activation.py), published in MXFP4
  (engine/quant/mxfp4.py keeps them 4-bit).

transformers' modeling_gpt_oss.py is the reference for the math. The checkpoint's layout
differs from the engine's in three places, mapped at load (`engine_names`):

    mlp.router.{weight,bias}          -> mlp.gate.*             (SparseMoeBlock's router)
    experts.gate_up_proj   [E, H, 2I] -> [E, 2I, H], gate rows then up rows
                                         (the checkpoint interleaves them: gate 0, up 0, ...)
    experts.down_proj      [E, I, H]  -> [E, H, I]
    experts.*_blocks / *_scales       gate_up rows de-interleaved the same way (MXFP4)
"""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.layers.attention import SelfAttention
from kvbatch.engine.layers.moe import SparseMoeBlock
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.models.llama import DecoderLayer, LlamaForCausalLM, ModelConfig


class GptOssDecoderLayer(DecoderLayer):
    """Llama's layer (its forward) with sink attention and the gpt-oss experts."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.layer_attention(layer),
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            sinks=True,
        )
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssBackbone(nn.Module):
    """`model.*` of a gpt-oss checkpoint."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's forward over gpt-oss's layers; the same call as every decoder here."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        if cfg.moe is None:
            raise ValueError("a gpt-oss config needs its experts (num_local_experts)")
        self.config = cfg
        self.model = GptOssBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def engine_names(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the engine's names and layouts (the module doc's map)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if ".mlp.experts." in name:
            tensor = _expert_layout(name, tensor)
        out[name] = tensor
    return out


def _expert_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "gate_up_proj":  # [E, H, 2I] interleaved columns
        return _gate_then_up(tensor.transpose(1, 2), name)
    if leaf == "down_proj":  # [E, I, H]
        return tensor.transpose(1, 2).contiguous()
    if leaf in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
        return _gate_then_up(tensor, name)  # rows are dimension 1
    return tensor


def _gate_then_up(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Rows (dimension 1) gate 0, up 0, gate 1, ... reordered to all gates, then all ups."""
    if tensor.dim() < 2 or tensor.shape[1] % 2:
        raise ValueError(
            f"{name} has shape {list(tensor.shape)}: its dimension 1 must hold the interleaved "
            "gate and up rows of each expert (an even count)"
        )
    return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1).contiguous()


register_architecture(
    Architecture(
        "GptOssForCausalLM",
        "gpt_oss",
        GptOssForCausalLM,
        attention_bias=True,
        adapt_checkpoint=engine_names,
    )
)

"""Rotary position embedding (RoPE) with the checkpoint's scaling.

Frequencies follow transformers' rope initialisation so logits match it to float rounding:
`default` (plain), `linear` (positions divided by a factor), `llama3` (Llama 3.1's
frequency-dependent smoothing between long and short wavelengths) and `longrope` (Phi-3's
"su" scaling: a per-frequency divisor, short or long, and a factor on cos and sin). A partial
rotary factor (Phi-4-mini) rotates the first dimensions of each head only. cos/sin are
computed for the positions of each step rather than cached for the whole context: the cost is one
[num_tokens, head_dim/2] outer product per step, and no cache to size or to outgrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # the name of Phi-3's first 128k checkpoints


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters read from a Hugging Face config (rope_parameters or rope_scaling)."""

    head_dim: int  # the rotated dimensions: head_dim x partial_rotary_factor
    theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict = field(default_factory=dict)
    # longrope: the long factors when the engine serves contexts past the pretraining length
    # (`with_context_len`); short ones otherwise, as transformers picks for shorter sequences.
    long_context: bool = False
    max_position_embeddings: int = 0  # longrope's default attention factor is derived from it

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
                if key not in self.scaling:
                    raise ValueError(f"longrope scaling needs {key!r} in rope_scaling")
            for key in ("short_factor", "long_factor"):
                if len(self.scaling[key]) != self.head_dim // 2:
                    raise ValueError(
                        f"longrope {key} has {len(self.scaling[key])} values; the rotated "
                        f"head dimension {self.head_dim} needs {self.head_dim // 2}"
                    )

    def with_context_len(self, max_model_len: int) -> RopeConfig:
        """The RoPE a context of up to `max_model_len` tokens runs with. longrope's short and
        long factors rotate differently, and a KV cache needs one rotation for every token of
        a sequence: the engine picks the long factors for all tokens when its context can
        pass the pretraining length (transformers recomputes the whole sequence with them
        once it does), the short ones otherwise."""
        if self.rope_type != "longrope":
            return self
        original = int(self.scaling["original_max_position_embeddings"])
        return replace(self, long_context=max_model_len > original)

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (LongRoPE's, from the context extension; 1 for others)."""
        if self.rope_type != "longrope":
            return 1.0
        given = self.scaling.get("attention_factor")
        if given is not None:
            return float(given)
        original = float(self.scaling["original_max_position_embeddings"])
        factor = self.scaling.get("factor") or self.max_position_embeddings / original
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original))


def inverse_frequencies(cfg: RopeConfig) -> torch.Tensor:
    """The per-pair rotation speeds, [head_dim / 2] float32, after the checkpoint's scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_type == "linear":
        return inv_freq / float(cfg.scaling["factor"])
    if cfg.rope_type == "llama3":
        return _llama3_scale(inv_freq, cfg.scaling)
    if cfg.rope_type == "longrope":
        ext = cfg.scaling["long_factor" if cfg.long_context else "short_factor"]
        return inv_freq / torch.tensor(ext, dtype=torch.float32)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend
    in between (the same formula as transformers' `_compute_llama3_parameters`)."""
    factor = float(s["factor"])
    low_freq_factor = float(s["low_freq_factor"])
    high_freq_factor = float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to flat q/k: [num_tokens, num_heads, head_dim] with one position per token."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.attention_factor = cfg.attention_factor
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def fit_context(self, max_model_len: int) -> None:
        """Rotate for contexts of up to `max_model_len` tokens (RopeConfig.with_context_len:
        LongRoPE's long factors past the pretraining length); others are unchanged."""
        cfg = self.config.with_context_len(max_model_len)
        if cfg != self.config:
            self.config = cfg
            self.inv_freq.copy_(inverse_frequencies(cfg))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin, each [num_tokens, 1, rotated dims], computed in float32 like
        transformers (and scaled by the attention factor there)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotated/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half form (transformers' layout, not the interleaved one). With a partial
        rotary factor cos/sin cover the first dimensions only; the rest pass unchanged."""
        rot = cos.shape[-1]
        if rot < x.shape[-1]:
            x_rot, x_pass = x[..., :rot], x[..., rot:]
            return torch.cat((RotaryEmbedding.apply(x_rot, cos, sin), x_pass), dim=-1)
        half = rot // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def rope_config_from_hf(hf_config, head_dim: int, params: dict | None = None) -> RopeConfig:
    """Read RoPE settings from transformers 5 (`rope_parameters`) or 4 (`rope_theta` +
    `rope_scaling`) configs; `params` overrides them (Gemma 3's local layers have their own)."""
    if params is None:
        params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    partial = float(
        params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    )
    if rope_type == "longrope":
        params.setdefault(
            "original_max_position_embeddings",
            getattr(hf_config, "original_max_position_embeddings", None),
        )
    skip = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
    scaling = {k: v for k, v in params.items() if k not in skip and v is not None}
    return RopeConfig(
        head_dim=int(head_dim * partial),
        theta=theta,
        rope_type=rope_type,
        scaling=scaling,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 0) or 0),
    )

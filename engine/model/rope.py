"""Rotary position embedding (RoPE) with the checkpoint's scaling.

Frequencies follow transformers' rope initialisation so logits match it to float rounding:
`default` (plain), `linear` (positions divided by a factor) and `llama3` (Llama 3.1's
frequency-dependent smoothing between long and short wavelengths). cos/sin are computed for
the positions of each step rather than cached for the whole context: the cost is one
[num_tokens, head_dim/2] outer product per step, and no cache to size or to outgrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters read from a Hugging Face config (rope_parameters or rope_scaling)."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )


def inverse_frequencies(cfg: RopeConfig) -> torch.Tensor:
    """The per-pair rotation speeds, [head_dim / 2] float32, after the checkpoint's scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_type == "linear":
        return inv_freq / float(cfg.scaling["factor"])
    if cfg.rope_type == "llama3":
        return _llama3_scale(inv_freq, cfg.scaling)
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
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin, each [num_tokens, 1, head_dim], computed in float32 like transformers."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half form (transformers' layout, not the interleaved one)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def rope_config_from_hf(hf_config, head_dim: int) -> RopeConfig:
    """Read RoPE settings from transformers 5 (`rope_parameters`) or 4 (`rope_theta` +
    `rope_scaling`) configs."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    scaling = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    return RopeConfig(head_dim=head_dim, theta=theta, rope_type=rope_type, scaling=scaling)

"""Rotary position embedding (RoPE) with the checkpoint's scaling.

Frequencies follow transformers' rope initialisation so logits match it to float rounding:
`default` (plain), `linear` (positions divided by a factor), `llama3` (Llama 3.1's
frequency-dependent smoothing between long and short wavelengths), `longrope` (Phi-3's "su"
scaling: a per-frequency divisor, short or long, and a factor on cos and sin) and `yarn`
(Qwen2.5 / Qwen3 long-context configs: a per-frequency blend of the plain and the interpolated
speeds, and a factor on cos and sin). `dynamic` (NTK) is refused: transformers recomputes its
frequencies from each forward's longest position, so keys already cached were rotated with
other speeds than later ones, which no paged KV cache reproduces. A partial rotary factor
(Phi-4-mini) rotates the first dimensions of each head only. cos/sin are computed for the
positions of each step rather than cached for the whole context: the cost is one
[num_tokens, head_dim/2] outer product per step, and no cache to size or to outgrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # the name of Phi-3's first 128k checkpoints
REFUSED_ROPE_TYPES = {
    "dynamic": (
        "transformers recomputes dynamic-NTK frequencies from the longest position of each "
        "forward once a sequence passes max_position_embeddings, so the keys it cached earlier "
        "were rotated with other frequencies than later ones; a paged KV cache cannot reproduce "
        "that. Up to max_position_embeddings tokens it equals the default RoPE: remove "
        "rope_scaling / rope_parameters' scaling from config.json to run it that way, or use a "
        "checkpoint with yarn or linear scaling"
    ),
}
"""RoPE types known and refused on purpose, with the reason and what to do instead."""


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
        if self.rope_type in REFUSED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported: "
                f"{REFUSED_ROPE_TYPES[self.rope_type]}"
            )
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
        if self.rope_type == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if self.scaling.get(key) is None:
                    raise ValueError(f"yarn scaling needs {key!r} in rope_scaling")

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
        """The factor on cos and sin (LongRoPE's and YaRN's, from the context extension; 1 for
        others)."""
        if self.rope_type == "yarn":
            return _yarn_attention_factor(self.scaling)
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
    if cfg.rope_type == "yarn":
        return _yarn_inverse_frequencies(cfg.theta, dim, cfg.scaling)
    if cfg.rope_type == "proportional":
        return _proportional_inverse_frequencies(cfg.theta, dim, cfg.scaling)
    return inv_freq


def _proportional_inverse_frequencies(base: float, dim: int, s: dict) -> torch.Tensor:
    """Gemma 4's full layers: the first partial_rotary_factor of the pairs turn at the speeds
    of a head of `dim` dimensions (not of the rotated part alone, as a partial rotary factor
    elsewhere), the rest at speed zero (cos 1, sin 0: unrotated), all divided by `factor`;
    transformers' `_compute_proportional_rope_parameters`."""
    angles = int(float(s.get("partial_rotary_factor", 1.0)) * dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim
    rotated = 1.0 / (base**exponents)
    still = torch.zeros(dim // 2 - angles, dtype=torch.float32)
    return torch.cat((rotated, still)) / float(s.get("factor", 1.0))


def _yarn_attention_factor(s: dict) -> float:
    """YaRN's factor on cos and sin (the paper's mscale, 0.1 ln(factor) + 1), or the config's
    attention_factor; with mscale and mscale_all_dim (DeepSeek's configs) their ratio, as
    transformers' `_compute_yarn_parameters`."""
    given = s.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(s["factor"])
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(base: float, dim: int, s: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): pairs that turn more than beta_fast times over the pretraining
    length keep their speed (extrapolation), those that turn fewer than beta_slow times are
    slowed by `factor` (interpolation), with a linear ramp between; the same float32
    arithmetic as transformers' `_compute_yarn_parameters`."""
    factor = float(s["factor"])
    original = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the pair keeps its speed; 0: slowed by factor
    return interpolation * (1 - keep) + extrapolation * keep


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
    max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if rope_type in ("longrope", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            getattr(hf_config, "original_max_position_embeddings", None),
        )
    if rope_type == "yarn":  # transformers' defaults: the whole context, and its ratio
        if params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = max_positions
        if params.get("factor") is None and params["original_max_position_embeddings"]:
            params["factor"] = max_positions / params["original_max_position_embeddings"]
    skip = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
    scaling = {k: v for k, v in params.items() if k not in skip and v is not None}
    if rope_type == "proportional":  # every dimension is in the rotation, some at speed 0
        scaling["partial_rotary_factor"], partial = partial, 1.0
    return RopeConfig(
        head_dim=int(head_dim * partial),
        theta=theta,
        rope_type=rope_type,
        scaling=scaling,
        max_position_embeddings=max_positions,
    )

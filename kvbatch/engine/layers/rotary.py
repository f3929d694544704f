"""RoPE as a layer: a step's rotation is made once from its positions, then each layer's
attention rotates its q and k with it.

    torch path   cos and sin tables [T, 1, rotated dims] (float32, then the model's dtype, as
                 transformers computes them), applied out of place in rotate-half form
    triton path  the positions and inverse frequencies; kernels/rotary.py rotates q and k in
                 place (LongRoPE's attention factor multiplied in after)

With a partial rotary factor only the first dimensions turn; the rest pass unchanged. The
frequencies themselves (scaling types, LongRoPE's factors) are engine/model/rope.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.layers.kernel_op import KernelOp
from kvbatch.engine.model.rope import RopeConfig, inverse_frequencies
from kvbatch.kernels.rotary import apply_rotary_


@dataclass(frozen=True)
class CosSinRotation:
    """The torch path's rotation: cos and sin per token (scaled by the attention factor)."""

    cos: torch.Tensor  # [T, 1, rotated dims]
    sin: torch.Tensor

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            RotaryEmbedding.apply(q, self.cos, self.sin),
            RotaryEmbedding.apply(k, self.cos, self.sin),
        )


@dataclass(frozen=True)
class InPlaceRotation:
    """The triton path's rotation: q and k turned in place by kernels/rotary.py."""

    positions: torch.Tensor  # [T] int64
    inv_freq: torch.Tensor  # [rotated dims / 2] float32
    attention_factor: float

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rot = 2 * self.inv_freq.shape[0]
        q_rot, k_rot = (q[..., :rot], k[..., :rot]) if rot < q.shape[-1] else (q, k)
        apply_rotary_(q_rot, k_rot, self.positions, self.inv_freq)
        if self.attention_factor != 1.0:
            q_rot.mul_(self.attention_factor)
            k_rot.mul_(self.attention_factor)
        return q, k


Rotation = CosSinRotation | InPlaceRotation


class RotaryEmbedding(KernelOp):
    """`rotary(positions, dtype)` is the step's Rotation; `rotation(q, k)` applies it to flat
    q/k: [num_tokens, num_heads, head_dim] with one position per token."""

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

    def rebuild(self, device: torch.device) -> None:
        """Recompute the frequencies on `device` (a model built on the meta device has none)."""
        self.inv_freq = inverse_frequencies(self.config).to(device)

    def forward_torch(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        return CosSinRotation(*self.cos_sin(positions, dtype))

    def forward_triton(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        return InPlaceRotation(positions, self.inv_freq, self.attention_factor)

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

"""What one layer's attention computes beyond plain causal softmax attention.

Most layers attend to every earlier token with scores q.k / sqrt(head_dim). Some models change
that per layer, and the backends take it as an argument of every call:

- a sliding window (Mistral's `sliding_window`, Gemma's local layers, Phi-3-4k): the query at
  position p sees keys at positions p - window + 1 .. p (`window` keys, itself included: the
  convention of transformers' masks);
- a scale other than head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5);
- logit soft-capping (Gemma 2): scores become cap * tanh(scores / cap) before the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention variant; the default is full causal attention."""

    sliding_window: int | None = None  # keys per query, itself included; None: every key
    scale: float | None = None  # None: head_dim ** -0.5
    softcap: float | None = None  # None: no soft-capping

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be 1 or more; got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"attention logit soft-cap must be positive; got {self.softcap}")

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.scale is None and self.softcap is None

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[..., Q, K] bool: causal, and inside the window when the layer has one."""
        mask = k_pos[..., None, :] <= q_pos[..., :, None]
        if self.sliding_window is not None:
            mask &= k_pos[..., None, :] > q_pos[..., :, None] - self.sliding_window
        return mask


FULL_ATTENTION = LayerAttention()

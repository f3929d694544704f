"""The per-layer scales of an FP8 KV cache (kv_cache_dtype="fp8")."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVScales:
    """One layer's FP8 KV-cache scales: the cache stores K / k and V / v in E4M3 (max 448).

    The default, 1.0, suits models whose K and V stay well inside +-448 (RoPE'd keys and values
    of common checkpoints are within a few tens); a checkpoint whose quantization_config has a
    kv_cache_scheme carries calibrated per-layer k_scale / v_scale, which the loader sets on
    each attention layer (`Attention.kv_scales`). A cache in any other dtype ignores them."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        if not (self.k > 0 and self.v > 0) or self.k == float("inf") or self.v == float("inf"):
            raise ValueError(
                f"KV cache scales must be finite and > 0, got k={self.k}, v={self.v} "
                "(check the checkpoint's k_scale / v_scale)"
            )

    @classmethod
    def from_checkpoint(cls, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
        """A layer's scales from its checkpoint tensors (`self_attn.k_scale` / `v_scale`, one
        value each; a missing one stays 1.0). Per-head or per-channel KV scales are refused:
        the kernels take one value per layer."""
        values = []
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is not None and t.numel() != 1:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}: only one KV-cache scale per layer "
                    "(a per-tensor kv_cache_scheme) is supported"
                )
            values.append(1.0 if t is None else float(t.reshape(()).float()))
        return cls(*values)


UNIT_KV_SCALES = KVScales()

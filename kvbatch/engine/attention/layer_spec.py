"""What one layer's attention computes beyond plain causal softmax attention.

Most layers attend to every earlier token with scores q.k / sqrt(head_dim). Some models change
that per layer, and the backends take it as an argument of every call:

- a sliding window (Mistral's `sliding_window`, Gemma's local layers, Phi-3-4k): the query at
  position p sees keys at positions p - window + 1 .. p (`window` keys, itself included: the
  convention of transformers' masks);
- a scale other than head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5);
- logit soft-capping (Gemma 2): scores become cap * tanh(scores / cap) before the softmax;
- attention sinks (gpt-oss): one learned logit per head joins the softmax's denominator and
  takes no value, so a query may attend to "nothing" (the output shrinks towards zero):

      out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink))

  Any path that has (out, lse) of its keys adds the sink exactly afterwards (`join_sink`):
  out * exp(lse - logaddexp(lse, sink)); a merge of partial results counts it once.

`attend` is that attention in plain torch (the torch backend's, and cascade's scores); the
Triton kernels take the same three settings as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention variant; the default is full causal attention."""

    sliding_window: int | None = None  # keys per query, itself included; None: every key
    scale: float | None = None  # None: head_dim ** -0.5
    softcap: float | None = None  # None: no soft-capping
    # [num_heads] float: the layer's sink logits (a model parameter, set at run time by the
    # layer: `with_sinks`); None: no sinks. Not compared: variants equal apart from their
    # sink values share kernels.
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be 1 or more; got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"attention logit soft-cap must be positive; got {self.softcap}")

    @property
    def is_plain(self) -> bool:
        return (
            self.sliding_window is None
            and self.scale is None
            and self.softcap is None
            and self.sinks is None
        )

    def with_sinks(self, sinks: torch.Tensor | None) -> LayerAttention:
        """This variant with the layer's sink logits (None: without)."""
        return self if sinks is None and self.sinks is None else replace(self, sinks=sinks)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[..., Q, K] bool: causal, and inside the window when the layer has one."""
        mask = k_pos[..., None, :] <= q_pos[..., :, None]
        if self.sliding_window is not None:
            mask &= k_pos[..., None, :] > q_pos[..., :, None] - self.sliding_window
        return mask


FULL_ATTENTION = LayerAttention()


def attend(
    q: torch.Tensor,  # [B, heads, Q, head_dim]
    k: torch.Tensor,  # [B, kv_heads, S, head_dim]
    v: torch.Tensor,  # [B, kv_heads, S, head_dim]
    mask: torch.Tensor,  # bool, broadcast to [B, heads, Q, S]
    layer: LayerAttention = FULL_ATTENTION,
) -> torch.Tensor:  # [B, heads, Q, head_dim]
    """Masked softmax attention with the layer's scale, soft-cap and sinks. SDPA where it can
    (it has neither); otherwise the scores are formed, capped and normalised in float32, as
    transformers' eager attention does for Gemma 2 and gpt-oss (the sink a last column)."""
    if layer.softcap is None and layer.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = soft_capped_scores(q, k, layer).masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if layer.sinks is not None:
        probs = probs[..., :-1]  # the sink takes no value
    return torch.matmul(probs.to(q.dtype), v)


def join_sink(
    out: torch.Tensor,  # [..., heads, d] attention over some keys, normalised over them
    lse: torch.Tensor,  # [..., heads] natural-log log-sum-exp of those keys' scores
    sinks: torch.Tensor,  # [heads]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with the sink joined to the denominator: lse' = logaddexp(lse, sink),
    out' = out * exp(lse - lse'). A row with no key (lse -inf) gives 0 and lse' = sink."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype))
    return out * torch.exp(lse - total)[..., None].to(out.dtype), total


def score_scale(q: torch.Tensor, layer: LayerAttention) -> float:
    """The factor on q.k: the layer's scale, or head_dim ** -0.5."""
    return q.shape[-1] ** -0.5 if layer.scale is None else layer.scale


def soft_capped_scores(q: torch.Tensor, k: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """q k^T times the layer's scale, then cap * tanh(scores / cap) when it has a cap."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * score_scale(q, layer)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    return scores

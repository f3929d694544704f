"""The mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, Qwen2-MoE, gpt-oss) as a layer.

A router scores every expert per token, the top k run, and their outputs are summed with the
routing weights. The experts' weights are stacked at load, as the fused kernel wants them:

    experts.gate_up_proj  [E, 2I, H]   gate rows then up rows of each expert
    experts.down_proj     [E, H, I]

(transformers 5 holds them the same way; engine/model/experts_loader.py stacks a checkpoint's
per-expert tensors, and engine/model/moe.py reads the config). Tokens run through
kernels/fused_moe.py: the Triton kernel on the triton backend and on CUDA, its torch reference
elsewhere; both compute the same sum. The softmax of the router is taken in float32, as
transformers does, whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvbatch.engine.layers.kernel_op import KernelOp
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.model.moe import MoeConfig
from kvbatch.kernels.fused_moe import ExpertBiases, fused_moe, fused_moe_ref

ExpertsFn = Callable[..., torch.Tensor]
"""fused_moe's signature: (x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, H]."""


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] (float32), expert ids [T, k]
    """Softmax in float32 over the experts, the top k, optionally renormalised."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts(nn.Module):
    """Every expert's SwiGLU weights in two stacked tensors (names as transformers 5's)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if bias:  # gpt-oss
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    @property
    def biases(self) -> ExpertBiases | None:
        if not hasattr(self, "down_proj_bias"):
            return None
        return ExpertBiases(self.gate_up_proj_bias, self.down_proj_bias)


class SparseMoeBlock(KernelOp):
    """Router, stacked experts and (Qwen2-MoE) the shared expert, a SwiGLU MLP every token
    runs; `mlp.*` in checkpoints. The experts run kernels/fused_moe.py: its Triton kernel on
    the triton backend and on CUDA, its torch reference on the CPU's torch backend."""

    def __init__(self, hidden_size: int, cfg: MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(hidden_size, cfg.num_experts, bias=cfg.router_bias)  # the router
        self.experts = StackedExperts(
            cfg.num_experts, hidden_size, cfg.intermediate_size, bias=cfg.expert_bias
        )
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, cfg.shared_expert_intermediate_size, "silu")
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, fused_moe if x.is_cuda else fused_moe_ref)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, fused_moe)

    def run(self, x: torch.Tensor, experts_fn: ExpertsFn) -> torch.Tensor:  # [T, H] -> [T, H]
        """The block's output with `experts_fn` (fused_moe or its reference) for the experts."""
        weights, ids = route(self.gate(x), self.cfg.top_k, self.cfg.renormalize)
        out = experts_fn(
            x,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            weights,
            ids,
            biases=self.experts.biases if self.cfg.expert_bias else None,
            activation=self.cfg.activation,
        )
        if self.cfg.shared_expert_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

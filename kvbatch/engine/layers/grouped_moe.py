"""DeepSeek-V3's mixture-of-experts block (and Mistral 4's): a grouped top-k router, the
routed experts in the fused MoE kernel, and shared experts every token runs.

    scores   = sigmoid(x W_g^T) in float32 (Mistral 4: softmax)
    choice   = scores + e_score_correction_bias          (DeepSeek-V3; changes the choice only)
    groups   = n_group groups of experts, each scored by the sum of its best two choices;
               the topk_group best groups are kept, the others' experts masked out
    experts  = top k of `choice` among the kept groups
    weights  = scores of those experts (not `choice`), / their sum if norm_topk_prob,
               x routed_scaling_factor
    out      = sum_k weights_k expert_k(x) + shared_experts(x)

The routed experts are SparseMoeBlock's (stacked at load, engine/model/experts_loader.py;
quantized experts replace them as for any MoE), so only the router and the shared experts'
names (`mlp.gate`, `mlp.shared_experts`) are this file's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.layers.moe import ExpertsFn, SparseMoeBlock, StackedExperts
from kvbatch.engine.model.latent_attention import GroupedRouting
from kvbatch.engine.model.moe import MoeConfig


class GroupedTopkRouter(nn.Module):
    """`mlp.gate`: the router's weight [E, H] and DeepSeek-V3's correction bias [E]."""

    def __init__(self, hidden_size: int, moe: MoeConfig, routing: GroupedRouting) -> None:
        super().__init__()
        if moe.num_experts % routing.num_groups:
            raise ValueError(
                f"n_routed_experts ({moe.num_experts}) must be a multiple of n_group "
                f"({routing.num_groups})"
            )
        self.moe, self.routing = moe, routing
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        if routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] float32 and expert ids [T, k] (the module doc's rule)."""
        routing, moe = self.routing, self.moe
        if routing.scoring == "sigmoid":
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        else:  # Mistral 4 scores in the model's dtype, as transformers does
            scores = F.linear(x, self.weight).softmax(-1).float()
        choice = scores
        if routing.correction_bias:
            choice = scores + self.e_score_correction_bias.float()
        if routing.topk_groups < routing.num_groups:
            per_group = choice.view(-1, routing.num_groups, moe.num_experts // routing.num_groups)
            group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
            kept = torch.topk(group_scores, routing.topk_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            mask = mask[:, :, None].expand_as(per_group).reshape(-1, moe.num_experts)
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routing.scaling, ids


class GroupedMoeBlock(SparseMoeBlock):
    """`mlp.*` of a DeepSeek-V3 / Mistral 4 MoE layer: router, stacked experts, shared
    experts. Runs the fused MoE kernel (or its reference) as SparseMoeBlock does."""

    def __init__(self, hidden_size: int, moe: MoeConfig, routing: GroupedRouting) -> None:
        nn.Module.__init__(self)
        self.cfg = moe
        self.gate = GroupedTopkRouter(hidden_size, moe, routing)
        self.experts = StackedExperts(moe.num_experts, hidden_size, moe.intermediate_size)
        if routing.num_shared_experts:
            shared = moe.intermediate_size * routing.num_shared_experts
            self.shared_experts = GatedMLP(hidden_size, shared, "silu")

    def run(self, x: torch.Tensor, experts_fn: ExpertsFn) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)
        out = experts_fn(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

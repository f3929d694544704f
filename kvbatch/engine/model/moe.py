"""The experts of a mixture-of-experts model (Mixtral, Qwen3-MoE, Qwen2-MoE): their config,
and a checkpoint's per-expert tensors grouped by layer and stacked as the block wants them
(engine/layers/moe.py runs the block; engine/model/experts_loader.py loads it).

Routers differ by model, as their configs say:
- Mixtral: softmax over the experts, top k, the k weights renormalised to sum to one.
- Qwen3-MoE and Qwen2-MoE: the same, renormalised only when `norm_topk_prob` is set.
- Qwen2-MoE adds a shared expert (a dense SwiGLU MLP every token runs) scaled by a sigmoid gate.
- DeepSeek-V3 and Mistral 4: a grouped top-k router (sigmoid or softmax scores, a correction
  bias that changes the choice only, a scaling factor), shared experts, and dense first layers
  (engine/layers/grouped_moe.py; the routing rule is engine/model/latent_attention.py's).
- gpt-oss: a router with a bias, the top k logits softmaxed (the same weights as the softmax
  over all experts renormalised over the top k); experts with biases and a clamped SwiGLU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from kvbatch.engine.model.tensor_names import some_names
from kvbatch.kernels.moe_activation import ClampedSwiGLU

MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "Mistral4ForCausalLM",
)


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a model: how many, how many run per token, and which layers have them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # divide the top-k weights by their sum
    sparse_step: int = 1  # layer i has experts when (i + 1) % sparse_step == 0 ...
    dense_layers: frozenset[int] = field(default_factory=frozenset)  # ... and i is not here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    router_bias: bool = False  # gpt-oss: the router has a bias
    expert_bias: bool = False  # gpt-oss: both projections of every expert have biases
    activation: ClampedSwiGLU | None = None  # gpt-oss's clamped SwiGLU; None: SiLU-and-mul

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of "
                f"experts ({self.num_experts})"
            )
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be 1 or more; got {self.sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) runs experts rather than the dense MLP."""
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers

    @property
    def active_intermediate_size(self) -> int:
        """The feed-forward width one token runs through (its k experts and the shared one)."""
        return self.top_k * self.intermediate_size + self.shared_expert_intermediate_size

    @classmethod
    def from_hf(cls, architecture: str, hf_config) -> MoeConfig | None:
        """The experts of a transformers config; None for dense architectures."""
        if architecture == "MixtralForCausalLM":
            return cls(
                num_experts=hf_config.num_local_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size,
                renormalize=True,
            )
        if architecture in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
            return cls(
                num_experts=hf_config.num_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.moe_intermediate_size,
                renormalize=bool(hf_config.norm_topk_prob),
                sparse_step=hf_config.decoder_sparse_step,
                dense_layers=frozenset(getattr(hf_config, "mlp_only_layers", None) or ()),
                shared_expert_intermediate_size=getattr(
                    hf_config, "shared_expert_intermediate_size", 0
                )
                or 0,
            )
        if architecture == "Qwen3_5MoeForCausalLM":  # every layer sparse, always renormalised
            return cls(
                num_experts=hf_config.num_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.moe_intermediate_size,
                renormalize=True,
                shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
            )
        if architecture in ("DeepseekV3ForCausalLM", "Mistral4ForCausalLM"):
            dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
            return cls(
                num_experts=hf_config.n_routed_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.moe_intermediate_size,
                renormalize=bool(hf_config.norm_topk_prob),
                dense_layers=frozenset(range(dense)),
                shared_expert_intermediate_size=hf_config.moe_intermediate_size
                * int(getattr(hf_config, "n_shared_experts", 0) or 0),
            )
        if architecture == "GptOssForCausalLM":
            return cls(
                num_experts=hf_config.num_local_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size,
                renormalize=True,  # softmax over the top k logits
                router_bias=True,
                expert_bias=True,
                activation=ClampedSwiGLU(
                    float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)
                ),
            )
        return None


# One expert's tensor in a checkpoint: Mixtral's w1 (gate), w3 (up), w2 (down) under
# block_sparse_moe, or the Qwen MoEs' gate_proj, up_proj, down_proj under mlp; `weight` for a
# float checkpoint, a quantized format's tensors (weight_packed, qweight, weight_scale, ...)
# otherwise.
_PER_EXPERT = re.compile(
    r"^(?P<layer>.+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<tensor>\w+)$"
)
_PROJ = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
PROJECTIONS = ("gate", "up", "down")


@dataclass
class CheckpointExperts:
    """One layer's experts as a checkpoint stores them: per expert and projection, the
    checkpoint's name of that linear layer ("model.layers.0.block_sparse_moe.experts.3.w1")
    and its tensors by suffix ("weight", or a quantized format's)."""

    block: str  # the engine's name of the MoE block, "model.layers.0.mlp"
    linears: dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]]

    def linear_name(self, expert: int, proj: str) -> str:
        return self.linears[expert, proj][0]

    def tensors(self, expert: int, proj: str) -> dict[str, torch.Tensor]:
        return self.linears[expert, proj][1]

    def check_complete(self, num_experts: int) -> None:
        missing = [
            f"{self.block} expert {e} {proj}"
            for e in range(num_experts)
            for proj in PROJECTIONS
            if (e, proj) not in self.linears
        ]
        if missing:
            shown = some_names(missing, 5)
            raise ValueError(f"checkpoint is missing {len(missing)} expert weights: {shown}")
        extra = sorted({e for e, _ in self.linears if e >= num_experts})
        if extra:
            raise ValueError(
                f"{self.block} has weights of expert {extra[0]}, but config.json says "
                f"{num_experts} experts (0 to {num_experts - 1}): the config and the weights "
                "are of different models"
            )

    def stack_float(self, num_experts: int) -> dict[str, torch.Tensor]:
        """The engine's stacked float tensors: `experts.gate_up_proj` [E, 2I, H] and
        `experts.down_proj` [E, H, I] under the block's name."""
        for name, tensors in self.linears.values():
            if set(tensors) != {"weight"}:
                raise ValueError(
                    f"expert layer {name} holds {', '.join(sorted(tensors))}: quantized "
                    "tensors, but config.json's quantization_config (if any) leaves this "
                    "layer in float"
                )
        w = {key: tensors["weight"] for key, (_, tensors) in self.linears.items()}
        gate_up = [torch.cat([w[e, "gate"], w[e, "up"]]) for e in range(num_experts)]
        down = [w[e, "down"] for e in range(num_experts)]
        return {
            f"{self.block}.experts.gate_up_proj": torch.stack(gate_up),
            f"{self.block}.experts.down_proj": torch.stack(down),
        }


def collect_expert_tensors(
    state_dict: dict[str, torch.Tensor], num_experts: int
) -> tuple[dict[str, torch.Tensor], list[CheckpointExperts]]:
    """Split a checkpoint into its per-expert tensors, grouped by layer (taken out of
    `state_dict`), and everything else, Mixtral's `block_sparse_moe.*` renamed `mlp.*`.
    Already stacked tensors (as transformers 5 saves them) stay with everything else."""
    rest: dict[str, torch.Tensor] = {}
    layers: dict[str, CheckpointExperts] = {}
    for name in list(state_dict):
        m = _PER_EXPERT.match(name)
        if m is None:
            rest[name.replace(".block_sparse_moe.", ".mlp.")] = state_dict.pop(name)
            continue
        block = f"{m['layer']}.mlp"
        linear = name[: -len(m["tensor"]) - 1]
        experts = layers.setdefault(block, CheckpointExperts(block, {}))
        _, tensors = experts.linears.setdefault((int(m["expert"]), _PROJ[m["proj"]]), (linear, {}))
        tensors[m["tensor"]] = state_dict.pop(name)
    for experts in layers.values():
        experts.check_complete(num_experts)
    return rest, list(layers.values())

"""Mistral 4 (Mistral Small 4): DeepSeek-V3's layer (engine/models/deepseek_v3.py: multi-head
latent attention, routed and shared experts) with three differences its config carries and
engine/model/latent_attention.py reads:

- the router scores experts by softmax (no correction bias), one group by default;
- the rotary part is `partial_rotary_factor` of head_dim = qk_nope + qk_rope, i.e. the
  qk_rope_head_dim dims, with YaRN (mscale in the softmax scale, as DeepSeek's);
- every query is multiplied by 1 + beta * log(1 + floor(position / original_max_position_
  embeddings)), beta = rope_parameters' `llama_4_scaling_beta` (Llama 4's attention
  temperature tuning), which lets attention sharpen past the pretraining length.

transformers' modeling_mistral4.py is the reference for the math.
"""

from __future__ import annotations

from kvbatch.engine.model.latent_attention import read_mla_family
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.models.deepseek_v3 import MlaForCausalLM, drop_mtp_layers

register_architecture(
    Architecture(
        "Mistral4ForCausalLM",
        "mistral4",
        MlaForCausalLM,
        attention_bias=True,
        adapt_checkpoint=drop_mtp_layers,
        read_family_config=read_mla_family,
    )
)

"""The mla bench's KV figures follow the engine's: the latent's (kv_lora_rank +
qk_rope_head_dim) x layers x dtype bytes, which is the engine's own bytes per token."""

from __future__ import annotations

from transformers import DeepseekV3Config

from kvbatch.bench.mla import kv_bytes_per_token


def test_deepseek_v3_latent_is_a_small_part_of_gqa_kv():
    per_token = kv_bytes_per_token(DeepseekV3Config(), gqa_kv_heads=8)
    assert per_token["mla"] == (512 + 64) * 61 * 2  # 70,272 bytes
    assert per_token["gqa"] == 2 * 8 * (128 + 64) * 61 * 2
    assert per_token["gqa"] / per_token["mla"] > 5

"""What freeing the KV blocks that have left every window of a layer would save, measured
before building it.

kvbatch's KV pool gives every layer the same block table: a sequence of L tokens holds
ceil(L / block_size) blocks in each layer, sliding-window layers included, although a local
layer of Gemma 3 only ever reads its last `sliding_window` keys. A pool that freed a local
layer's blocks once they left the window (a second, per-layer-kind block table, as vLLM's hybrid
KV manager keeps) would hold, per sequence,

    full layers     ceil(L / block_size) blocks each, as today
    window layers   at most ceil((window - 1) / block_size) + 1 blocks each

This module counts both for real Gemma 3 shapes (the layer kinds come from the engine's own
ModelConfig, read from transformers' Gemma3TextConfig) over a job's sequence lengths, and turns
them into what decides a batch job's speed once prompts are long: how many sequences the pool
holds at once (the decode batch) on an H200 after the weights.

    python -m kvbatch.bench.window_savings [--prompt-tokens 8192 32768] [--output-tokens 512]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import Gemma3TextConfig

from kvbatch.engine.core.args import DEFAULTS
from kvbatch.engine.models.llama import ModelConfig

H200_BYTES = 141e9
KV_MEMORY_FRACTION = DEFAULTS.kv_cache_memory_fraction  # of what is left after the weights
MAX_NUM_SEQS = DEFAULTS.max_num_seqs  # the scheduler's default cap on sequences at once

GEMMA3_SHAPES = {
    # Published Gemma 3 text configs (the fields that size weights and KV).
    "gemma-3-4b": dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
    ),
    "gemma-3-12b": dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
    ),
    "gemma-3-27b": dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
    ),
}  # fmt: skip


def gemma3_config(name: str) -> ModelConfig:
    """The engine's view of a Gemma 3 shape: transformers fills layer_types (five local layers
    to one global) and the engine reads which layers are windowed from it."""
    hf = Gemma3TextConfig(vocab_size=262208, **GEMMA3_SHAPES[name])
    hf.architectures = ["Gemma3ForCausalLM"]
    return ModelConfig.from_hf(hf)


def weight_bytes(cfg: ModelConfig, bytes_per_weight: float = 2.0) -> float:
    """bfloat16 weights: tied embedding, attention and GeGLU MLP per layer (norms left out)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    return bytes_per_weight * (cfg.vocab_size * cfg.hidden_size + cfg.num_layers * layer)


@dataclass(frozen=True)
class KvFootprint:
    """One sequence's KV blocks summed over layers, as the pool holds them today and as a pool
    that frees out-of-window blocks would."""

    blocks_now: int
    blocks_freed: int

    @property
    def saving(self) -> float:
        return 1.0 - self.blocks_freed / self.blocks_now


def footprint(
    cfg: ModelConfig, num_tokens: int, block_size: int = DEFAULTS.block_size
) -> KvFootprint:
    full_blocks = -(-num_tokens // block_size)
    now = freed = 0
    for layer in range(cfg.num_layers):
        now += full_blocks
        if cfg.is_sliding(layer):
            window_blocks = -(-(cfg.sliding_window - 1) // block_size) + 1
            freed += min(full_blocks, window_blocks)
        else:
            freed += full_blocks
    return KvFootprint(now, freed)


@dataclass(frozen=True)
class Row:
    model: str
    tokens: int
    kv_gb_now: float  # one sequence's KV, GB
    kv_gb_freed: float
    seqs_now: int  # sequences the pool holds at once (capped at MAX_NUM_SEQS)
    seqs_freed: int

    @property
    def batch_gain(self) -> float:
        return self.seqs_freed / max(self.seqs_now, 1)


def measure(model: str, prompt_tokens: int, output_tokens: int, *, kv_bytes: float = 2.0) -> Row:
    """The pool's capacity for sequences of prompt + output tokens (their size at the end,
    where they hold the most), today and with out-of-window blocks freed."""
    cfg = gemma3_config(model)
    block_size = DEFAULTS.block_size
    tokens = prompt_tokens + output_tokens
    fp = footprint(cfg, tokens, block_size)
    block_bytes = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * kv_bytes  # K and V
    pool = KV_MEMORY_FRACTION * (H200_BYTES - weight_bytes(cfg))
    now, freed = fp.blocks_now * block_bytes, fp.blocks_freed * block_bytes
    return Row(
        model,
        tokens,
        now / 1e9,
        freed / 1e9,
        min(MAX_NUM_SEQS, int(pool // now)),
        min(MAX_NUM_SEQS, int(pool // freed)),
    )


def table(rows: Sequence[Row]) -> str:
    head = "| model | tokens per sequence | KV per sequence now | freed | sequences at once now | freed | gain |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.tokens:,} | {r.kv_gb_now:.2f} GB | {r.kv_gb_freed:.2f} GB | "
            f"{r.seqs_now} | {r.seqs_freed} | {r.batch_gain:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=list(GEMMA3_SHAPES), choices=list(GEMMA3_SHAPES)
    )
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[2048, 8192, 32768, 131072])
    parser.add_argument("--output-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    rows = [measure(m, p, args.output_tokens) for m in args.models for p in args.prompt_tokens]
    print(table(rows))


if __name__ == "__main__":
    main()

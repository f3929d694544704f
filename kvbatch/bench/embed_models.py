"""Embedding models of real shapes with random weights, built from their configs (no download):
the checkpoints `kvbatch bench embed-gpu` runs.

Each folder is what a sentence-transformers checkpoint holds: config.json and
model.safetensors as transformers saves them, plus the module files that name the pooling
(modules.json, 1_Pooling/config.json, 2_Normalize/, sentence_bert_config.json). There is no
tokenizer: the benchmark feeds token ids, as its generative workloads do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbatch.bench.models import _cache_root, build_once


@dataclass(frozen=True)
class EmbedModelSpec:
    """One embedding model's shape. `kind` is "bert" (bidirectional encoder) or "qwen3"
    (a causal decoder, as Qwen3-Embedding); `pooling` a sentence-transformers mode."""

    name: str
    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    pooling: str
    max_seq_length: int
    num_kv_heads: int = 0  # qwen3: grouped-query attention
    head_dim: int = 0  # qwen3: 128 on the real model, whatever the width

    @property
    def causal(self) -> bool:
        return self.kind == "qwen3"

    @property
    def attention_width(self) -> int:
        """Query heads x head size: the width of the attention scores' contraction."""
        return self.num_heads * self.head_dim if self.kind == "qwen3" else self.hidden_size

    def non_embedding_parameters(self) -> int:
        """Parameters every token passes through (the embedding lookups excluded)."""
        h, f = self.hidden_size, self.intermediate_size
        if self.kind == "bert":
            attention = 4 * h * h + 4 * h
            ffn = 2 * h * f + f + h
            return self.num_layers * (attention + ffn + 4 * h)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        return self.num_layers * (attention + 3 * h * f + 2 * h)

    def config(self):
        if self.kind == "bert":
            from transformers import BertConfig

            return BertConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads,
                intermediate_size=self.intermediate_size,
                max_position_embeddings=self.max_seq_length,
                architectures=["BertModel"],
            )
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_seq_length,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            architectures=["Qwen3Model"],
        )


BGE_BASE = EmbedModelSpec(
    name="bge-base",
    kind="bert",
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    intermediate_size=3072,
    vocab_size=30522,
    pooling="cls",
    max_seq_length=512,
)
QWEN3_EMBEDDING_06B = EmbedModelSpec(
    name="qwen3-embedding-0.6b",
    kind="qwen3",
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151669,
    pooling="lasttoken",
    max_seq_length=8192,
)
EMBED_GPU_MODELS = {m.name: m for m in (BGE_BASE, QWEN3_EMBEDDING_06B)}
TINY_EMBED_GPU_MODELS = {
    m.name: m
    for m in (
        EmbedModelSpec("bge-base-tiny", "bert", 64, 2, 4, 128, 1000, "cls", 128),
        EmbedModelSpec(
            "qwen3-embedding-tiny", "qwen3", 64, 2, 4, 128, 1000, "lasttoken", 128,
            num_kv_heads=2, head_dim=16,
        ),
    )
}  # fmt: skip


def build_embed_model(
    spec: EmbedModelSpec, dtype: str, cache_dir: str | Path | None = None
) -> Path:
    """The folder of `spec` in `dtype` with seeded random weights, built once and cached."""
    dest = _cache_root(cache_dir) / "random-models" / f"embed-{spec.name}-{dtype}"
    return build_once(
        dest, lambda d: (d / "modules.json").is_file(), lambda tmp: _write(spec, dtype, tmp)
    )


def _write(spec: EmbedModelSpec, dtype: str, folder: Path) -> None:
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(spec.config())
    model.to(getattr(torch, dtype)).save_pretrained(str(folder), safe_serialization=True)
    # sentence-transformers' module files, as its save() writes them
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": spec.max_seq_length, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": spec.hidden_size,
                "pooling_mode_cls_token": spec.pooling == "cls",
                "pooling_mode_mean_tokens": spec.pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": spec.pooling == "lasttoken",
                "include_prompt": True,
            },
            indent=2,
        )
    )
    (folder / "2_Normalize").mkdir()

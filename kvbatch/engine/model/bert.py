"""BERT and RoBERTa encoders (all-MiniLM, bge-*, e5-*; XLM-RoBERTa's bge-m3, multilingual-e5-*,
all-distilroberta): the whole forward pass, bidirectional, no KV cache.

An encoder reads each input whole: every token attends to every other token of its input, so
nothing computed for one input is reusable by another (no prefix cache) and nothing is kept
after the forward (no KV pool). Inputs run as padded batches [batch, seq] with a key mask:

    embeddings = LayerNorm(word[ids] + position[p] + token_type[0])
        p = 0, 1, .., n-1                             (BERT)
        p = pad+1, pad+2, ..; a pad token gets pad    (RoBERTa: positions count non-pad tokens)
    per layer (post-LN):  x = LayerNorm(x + Wo . attention(Wq x, Wk x, Wv x; key mask))
                          x = LayerNorm(x + W2 . gelu(W1 x))           (exact erf GELU)

RoBERTa's layers are BERT's; only the position numbering differs (fairseq's, kept by
transformers), so both run here. Modules carry transformers' BertModel names (embeddings.
word_embeddings, encoder.layer.N.attention.self.query, ...), which RobertaModel's are too, so a
checkpoint's tensors load as they are named.

The checkpoint's `pooler` (a tanh dense over [CLS], BERT's next-sentence head) is not run:
sentence-transformers pools the last hidden states itself (engine/pooling/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvbatch.engine.model.architectures import (
    CROSS_ENCODER_ARCHITECTURES,
    ENCODER_ARCHITECTURES,
    ROBERTA_ARCHITECTURES,
    ROBERTA_DEFAULT_PAD_TOKEN_ID,
    encoder_max_input_length,
)
from kvbatch.engine.model.tensor_names import some_names


@dataclass(frozen=True)
class BertConfig:
    """What the forward needs from config.json; from_hf refuses what it does not run."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    # RoBERTa: the pad token id its positions start after (None: BERT, positions from 0)
    position_padding_idx: int | None = None
    has_lm_head: bool = False  # an encoder embeds; it never generates
    num_labels: int = 0  # a cross-encoder's scores per input (its head); 0: embeddings only

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_input_length(self) -> int:
        """The longest input the position table holds (514 rows, RoBERTa: 512 tokens)."""
        return encoder_max_input_length(
            self.architecture, self.max_position_embeddings, self.position_padding_idx
        )

    @classmethod
    def from_hf(cls, hf: dict) -> BertConfig:
        """From config.json as a dict. Raises ValueError naming the first feature the forward
        does not have (another activation, relative positions, a decoder or cross-attention)."""
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in ENCODER_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture} is not an encoder kvbatch runs "
                f"(supported: {', '.join(ENCODER_ARCHITECTURES)})"
            )
        problems = {
            "hidden_act": (hf.get("hidden_act", "gelu"), "gelu", "the exact (erf) GELU"),
            "position_embedding_type": (
                hf.get("position_embedding_type", "absolute"),
                "absolute",
                "absolute position embeddings",
            ),
            "is_decoder": (bool(hf.get("is_decoder", False)), False, "an encoder"),
            "add_cross_attention": (
                bool(hf.get("add_cross_attention", False)),
                False,
                "no cross-attention",
            ),
        }
        for key, (value, wanted, what) in problems.items():
            if value != wanted:
                raise ValueError(
                    f"{architecture} checkpoint has {key}={value!r}, which is not supported: "
                    f"kvbatch's BERT runs {what} ({key}={wanted!r})"
                )
        if hf.get("quantization_config"):
            raise ValueError(
                f"{architecture} checkpoint is quantized (quantization_config), which is not "
                "supported for encoders: use its float weights"
            )
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in (*required, "intermediate_size") if k not in hf]
        if missing:
            raise ValueError(f"{architecture} config.json lacks {', '.join(missing)}")
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads")
        cfg = cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            intermediate_size=int(hf["intermediate_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            position_padding_idx=_roberta_padding_idx(architecture, hf),
            num_labels=_num_labels(architecture, hf),
        )
        if cfg.max_input_length < 1:
            raise ValueError(
                f"{architecture} config.json's max_position_embeddings "
                f"{cfg.max_position_embeddings} leaves no position for an input after "
                f"pad_token_id {cfg.position_padding_idx}"
            )
        return cfg


def _num_labels(architecture: str, hf: dict) -> int:
    """A cross-encoder's label count as transformers reads it (id2label, else num_labels, else
    its default of 2); 0 for an encoder without a head."""
    if architecture not in CROSS_ENCODER_ARCHITECTURES:
        return 0
    labels = hf.get("id2label") or {}
    return len(labels) or int(hf.get("num_labels", 2))


def _roberta_padding_idx(architecture: str, hf: dict) -> int | None:
    """RoBERTa's pad token id (transformers' default when config.json lacks it); None for BERT.
    A RoBERTa config with pad_token_id null has no position numbering: refused."""
    if architecture not in ROBERTA_ARCHITECTURES:
        return None
    pad = hf.get("pad_token_id", ROBERTA_DEFAULT_PAD_TOKEN_ID)
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise ValueError(
            f"{architecture} config.json has pad_token_id={pad!r}: RoBERTa's positions start "
            "after the pad token id, so it must be a token id (1 in RoBERTa and XLM-RoBERTa)"
        )
    return pad


class _Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None
    ) -> torch.Tensor:
        # an input of one segment is token type 0; a cross-encoder's pair has 0s, then 1s
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_types is None:
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class _Residual(nn.Module):
    """dense, then LayerNorm over the sum with the sublayer's input (post-LN)."""

    def __init__(self, cfg: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _Residual(cfg, cfg.hidden_size)


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _Residual(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden]; key_mask: [batch, 1, 1, seq] bool, True on real tokens."""
        b, n, _ = x.shape
        qkv = self.attention.self
        q, k, v = (
            proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (qkv.query, qkv.key, qkv.value)
        )  # [batch, heads, seq, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # not causal
        x = self.attention.output(a.transpose(1, 2).reshape(b, n, -1), x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class _Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class BertModel(nn.Module):
    """The encoder: token ids in, last hidden states out (no pooler)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: [batch, seq] (padded past each input's length, with any id);
        lengths: [batch] on the same device; token_types: [batch, seq] segment ids (None: all
        0). Returns [batch, seq, hidden]; rows past an input's length are padding (they see
        the input, the input never sees them)."""
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        real = columns[None, :] < lengths[:, None]  # [batch, seq]
        x = self.embeddings(input_ids, self._positions(input_ids, real, columns), token_types)
        key_mask = real[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, key_mask)
        return x

    def _positions(
        self, input_ids: torch.Tensor, real: torch.Tensor, columns: torch.Tensor
    ) -> torch.Tensor:
        """Position ids: BERT's 0..seq-1 ([seq]); RoBERTa's as create_position_ids_from_
        input_ids numbers them ([batch, seq]): pad + the count of non-pad tokens so far, and
        pad itself on a pad token (and on the batch's padding rows, which nothing reads)."""
        pad = self.config.position_padding_idx
        if pad is None:
            return columns
        counted = (real & (input_ids != pad)).long()
        return torch.cumsum(counted, dim=1) * counted + pad


IGNORED_TENSORS = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
"""Tensors a BertModel checkpoint carries that the forward does not use: a buffer of
positions (0..max) and the next-sentence pooler, which sentence-transformers never runs."""


BASE_MODEL_PREFIXES = ("bert.", "roberta.")
"""transformers' base_model_prefix of BertModel and RobertaModel / XLMRobertaModel: a base model
saved from inside a task model (BertForMaskedLM, XLMRobertaForMaskedLM) names its tensors so,
and transformers strips it when it loads them into the base model."""


def bert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the modules' names: unused ones dropped, a base-model
    prefix stripped and old TF-era LayerNorm names (gamma, beta) renamed as transformers does.
    A task head's tensors (lm_head.*, cls.*) stay as they are, for build_bert to refuse."""
    out = {}
    for name, tensor in state_dict.items():
        for prefix in BASE_MODEL_PREFIXES:
            name = name.removeprefix(prefix)
        if name in IGNORED_TENSORS:
            continue
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        out[name.replace("LayerNorm.beta", "LayerNorm.bias")] = tensor
    return out


def build_bert(
    cfg: BertConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device
) -> BertModel:
    """The model with the checkpoint's weights. Raises ValueError naming missing tensors, or
    tensors config.json does not describe (a checkpoint that would load and answer wrongly)."""
    with torch.device("meta"):
        model = BertModel(cfg)
    weights = bert_state_dict(state_dict)
    owned = set(model.state_dict())
    missing, unused = sorted(owned - set(weights)), sorted(set(weights) - owned)
    for names, what in ((missing, "is missing"), (unused, "has unknown")):
        if names:
            shown = some_names(names)
            raise ValueError(
                f"{cfg.architecture} checkpoint {what} {len(names)} tensors ({shown}): "
                "config.json does not describe these weights"
            )
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    wrong = next((k for k in sorted(weights) if weights[k].shape != shapes[k]), None)
    if wrong is not None:
        raise ValueError(
            f"{cfg.architecture} checkpoint's {wrong} has shape {tuple(weights[wrong].shape)} "
            f"but config.json makes it {tuple(shapes[wrong])}: config.json does not describe "
            "these weights"
        )
    model.load_state_dict(
        {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}, assign=True
    )
    return model.eval()

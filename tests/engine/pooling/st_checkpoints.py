"""Tiny random embedding checkpoints with sentence-transformers' files, and the reference.

A checkpoint is a tiny random causal model (tests.tiny_models), BERT or RoBERTa with a word-level tokenizer
(the words "<0>" .. "<511>" are token ids 0 .. 511, so a text and its ids say the same thing;
the brackets keep the special tokens "<0>" and "<3>" from matching inside "<312>")
and the module files sentence-transformers itself writes (modules.json, 1_Pooling/,
2_Normalize/). sentence-transformers loads the same folder as the reference.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import VOCAB_SIZE, build_tiny_checkpoint

MODES = ("lasttoken", "mean", "cls")


def ids_to_text(ids: list[int]) -> str:
    return " ".join(f"<{i}>" for i in ids)


def save_word_tokenizer(path: Path, pad_token_id: int = 0, bos_eos: bool = False) -> None:
    """A tokenizer whose word "<N>" is token N; <pad_token_id> pads. No special tokens are
    added, unless `bos_eos`: then <0> and <2> enclose each text, as RoBERTa's <s> and </s>."""
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(VOCAB_SIZE)}, unk_token="<3>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {}
    if bos_eos:
        tok.post_processor = processors.TemplateProcessing(
            single="<0> $A <2>", special_tokens=[("<0>", 0), ("<2>", 2)]
        )
        special = {"bos_token": "<0>", "eos_token": "<2>"}
    pad = f"<{pad_token_id}>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token="<3>", **special)
    fast.save_pretrained(path)


def build_embedding_checkpoint(
    path: Path, kind: str = "llama-gqa", mode: str | None = "lasttoken", normalize: bool = True
) -> Path:
    """A tiny `kind` checkpoint at `path` with a word tokenizer and, unless `mode` is None,
    sentence-transformers' Pooling (`mode`) and Normalize (if `normalize`) modules."""
    path = Path(path)
    build_tiny_checkpoint(kind, path)
    save_word_tokenizer(path)
    if mode is None:
        return path
    return add_st_modules(path, mode, normalize)


def add_st_modules(path: Path, mode: str, normalize: bool = True) -> Path:
    """sentence-transformers' own module files (modules.json, 1_Pooling/, 2_Normalize/ if
    `normalize`) for the checkpoint at `path`, written beside its weights."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(path))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), mode)]
    if normalize:
        modules.append(Normalize())
    with tempfile.TemporaryDirectory() as tmp:
        SentenceTransformer(modules=modules, device="cpu").save(tmp)
        # The module files only: the weights stay those already at `path`.
        for name in ("modules.json", "sentence_bert_config.json", "1_Pooling", "2_Normalize"):
            src = Path(tmp) / name
            if src.is_dir():
                shutil.copytree(src, path / name)
            elif src.is_file():
                shutil.copy(src, path / name)
    return path


def tiny_bert_config(**overrides):
    """A tiny random BERT: 2 layers, 4 heads of 16, the word vocabulary of save_word_tokenizer.
    A wide initializer, so that inputs' vectors differ by more than the tests' tolerance."""
    from transformers import BertConfig

    args = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    return BertConfig(**{**args, **overrides})


def build_bert_checkpoint(
    path: Path, mode: str | None = "mean", normalize: bool = True, seed: int = 0, **overrides
) -> Path:
    """A tiny random BertModel at `path`, saved by transformers (with its pooler, as real
    checkpoints are), the word tokenizer, and unless `mode` is None sentence-transformers'
    module files."""
    from transformers import BertModel

    path = Path(path)
    torch.manual_seed(seed)
    BertModel(tiny_bert_config(**overrides)).save_pretrained(path)
    save_word_tokenizer(path)
    return path if mode is None else add_st_modules(path, mode, normalize)


ROBERTA_POSITIONS = 66
"""The tiny RoBERTas' position table: with pad_token_id 1, inputs of up to 64 tokens (as 514
rows hold 512 tokens in xlm-roberta-base, bge-m3's 8194 hold 8192)."""


def tiny_roberta_config(architecture: str = "XLMRobertaModel", **overrides):
    """A tiny random RoBERTa (`architecture` XLMRobertaModel or RobertaModel) shaped as the real
    ones are: one token type, pad_token_id 1, LayerNorm eps 1e-5, positions past the pad id."""
    from transformers import RobertaConfig, XLMRobertaConfig

    config_class = {"XLMRobertaModel": XLMRobertaConfig, "RobertaModel": RobertaConfig}
    args = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=ROBERTA_POSITIONS,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        initializer_range=0.2,
    )
    return config_class[architecture](**{**args, **overrides})


def build_roberta_checkpoint(
    path: Path,
    architecture: str = "XLMRobertaModel",
    mode: str | None = "cls",
    normalize: bool = True,
    seed: int = 0,
    **overrides,
) -> Path:
    """A tiny random XLMRobertaModel or RobertaModel at `path`, saved by transformers (with its
    pooler), the word tokenizer as RoBERTa's tokenizes (<0> text <2>, padding with <1>), and
    unless `mode` is None sentence-transformers' module files."""
    from transformers import RobertaModel, XLMRobertaModel

    model_class = {"XLMRobertaModel": XLMRobertaModel, "RobertaModel": RobertaModel}
    path = Path(path)
    torch.manual_seed(seed)
    config = tiny_roberta_config(architecture, **overrides)
    model_class[architecture](config).save_pretrained(path)
    save_word_tokenizer(path, pad_token_id=config.pad_token_id, bos_eos=True)
    return path if mode is None else add_st_modules(path, mode, normalize)


def save_as_sentence_transformers(src: Path, dst: Path) -> Path:
    """`src` (an embedding checkpoint) saved by sentence-transformers itself into `dst`: a
    base model (architecture e.g. LlamaModel, weights without "model.", no lm_head)."""
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(src), device="cpu").save(str(dst))
    return Path(dst)


def st_embeddings(path: Path, texts: list[str], **encode) -> torch.Tensor:
    """sentence-transformers' embeddings of `texts` ([n, dim] float32) from the folder."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts), **encode).float()


@torch.no_grad()
def st_embeddings_of_ids(path: Path, prompts: list[list[int]]) -> torch.Tensor:
    """sentence-transformers' pipeline on token ids, one prompt at a time (no tokenizer, no
    padding): the reference for checkpoints whose tokenizer class reads no word vocabulary
    (transformers gives a Qwen2 folder its own BPE tokenizer class)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    rows = []
    for ids in prompts:
        features = {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        }
        rows.append(model(features)["sentence_embedding"][0])
    return torch.stack(rows).float()

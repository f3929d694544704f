"""What `kvbatch submit` needs to know about a model without loading its weights: the
tokenizer (for chat templates and prompt lengths) and the context length."""

from __future__ import annotations

from pathlib import Path

from kvbatch.engine import (
    ENCODER_ARCHITECTURES,
    encoder_max_input_length,
    read_st_max_seq_length,
)


def _split_gguf(model: str) -> tuple[str, str] | None:
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return str(path.parent), path.name
    return None


def load_tokenizer(model: str):
    """The model's tokenizer: a Hugging Face folder (local files only) or a .gguf file."""
    from transformers import AutoTokenizer

    gguf = _split_gguf(model)
    if gguf is not None:
        folder, name = gguf
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(str(Path(model).expanduser()), local_files_only=True)


def max_model_len(model: str, override: int | None = None, tokenizer=None) -> int:
    """The longest sequence (prompt + output) the engine will run for `model`: the config's
    max_position_embeddings (a sliding window does not cap it: the engine masks windowed
    layers), or for an encoder the input length sentence-transformers truncates to, as its
    engine does (`tokenizer` tells whether do_lower_case changes anything). `override` must
    fit in the positions (for RoBERTa encoders, max_position_embeddings - pad_token_id - 1)."""
    from transformers import AutoConfig

    gguf = _split_gguf(model)
    if gguf is not None:
        cfg = AutoConfig.from_pretrained(gguf[0], gguf_file=gguf[1])
    else:
        cfg = AutoConfig.from_pretrained(str(Path(model).expanduser()), local_files_only=True)
    limit = int(cfg.max_position_embeddings)
    architecture = (getattr(cfg, "architectures", None) or [None])[0]
    if architecture in ENCODER_ARCHITECTURES:  # RoBERTa's positions start after the pad id
        limit = encoder_max_input_length(architecture, limit, getattr(cfg, "pad_token_id", None))
    if override is not None:
        if override < 1 or override > limit:
            raise ValueError(f"max_model_len={override} must be in [1, {limit}] for {model}")
        return override
    if architecture in ENCODER_ARCHITECTURES:
        return min(limit, read_st_max_seq_length(model, tokenizer) or limit)
    return limit

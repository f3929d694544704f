"""A format's marker as one token of a model's vocabulary."""

from __future__ import annotations


def marker_token(tokenizer, text: str) -> int | None:
    """The id of the one token that is `text` in `tokenizer`'s vocabulary, or None. A
    tokenizer that turns text it does not know into one unknown token has no such marker: the
    token must be `text` itself."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # a tokenizer that refuses the text has no such token
        return None
    if len(ids) != 1 or ids[0] == getattr(tokenizer, "unk_token_id", None):
        return None
    return ids[0] if tokenizer.convert_ids_to_tokens(ids[0]) == text else None

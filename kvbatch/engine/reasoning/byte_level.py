"""GPT-2's byte-level BPE alphabet, which o200k and most BPE tokenizers spell their pieces in:
each byte as one printable character. Both a token's bytes (logprobs' `bytes`) and the offline
o200k_base file (harmony_vocab.py) are read back through it."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """byte -> the character that stands for it in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping

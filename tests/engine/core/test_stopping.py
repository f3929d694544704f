"""Stop strings: found where a decode of the whole output finds them, from short tails."""

from __future__ import annotations

import random

import pytest

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.core.sequence import Sequence
from kvbatch.engine.core.stopping import StopChecker

# token id -> text: single characters, words, a leading-space word, and the three bytes of
# "€" split over three tokens (decoded alone they are replacement characters)
PIECES = ["a", "b", "c", " ", "ab", "bc", "cab", " the", "\n", "##", "#", "x"]
EURO = [len(PIECES), len(PIECES) + 1, len(PIECES) + 2]


class ByteTokenizer:
    """Decodes like a byte-level BPE: bytes joined, then UTF-8 with replacement."""

    def __init__(self) -> None:
        self.pieces = [p.encode() for p in PIECES] + [bytes([b]) for b in "€".encode()]
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.decoded_lengths.append(len(ids))
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def run(tokens: list[int], stop: list[str]) -> tuple[Sequence, int, ByteTokenizer]:
    """Append tokens one by one until the checker stops; returns (seq, tokens appended)."""
    tok = ByteTokenizer()
    checker = StopChecker((), max_model_len=10_000, tokenizer=tok)
    seq = Sequence("r", [0], SamplingParams(max_tokens=5_000, stop=stop))
    for n, t in enumerate(tokens, 1):
        seq.token_ids.append(t)
        if checker.check(seq, t):
            return seq, n, tok
    return seq, len(tokens), tok


def first_stop(tokens: list[int], stop: list[str]) -> int | None:
    """Reference: the first prefix length whose full decode contains a stop string."""
    tok = ByteTokenizer()
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n])
        if any(s in text for s in stop):
            return n
    return None


@pytest.mark.parametrize("seed", range(40))
def test_stops_exactly_where_the_whole_output_first_contains_a_stop_string(seed):
    rng = random.Random(seed)
    tokens = []
    while len(tokens) < 300:
        tokens += EURO if rng.random() < 0.05 else [rng.randrange(len(PIECES))]
    stop = rng.choice([["the\n"], ["cabab"], [" €"], ["###", "xx"], ["b c", "€€"]])
    seq, n, tok = run(tokens, stop)
    # every check decoded a short tail; only the one that found a stop decoded it all
    window = max(len(s.encode()) for s in stop) + 4
    assert max(tok.decoded_lengths[:-1]) <= window
    want = first_stop(tokens, stop)
    assert n == (want if want is not None else len(tokens))
    if want is not None:
        text = tok.decode(tokens[:n])
        at, hit = min((text.find(s), s) for s in stop if s in text)
        assert seq.finish_reason == "stop" and seq.stop_reason == hit
        assert seq.output_text == text[:at]


def test_no_stop_string_means_no_full_decode_per_token():
    tokens = [0, 1] * 400  # "abab...": never "c"
    seq, n, tok = run(tokens, ["c"])
    assert n == len(tokens) and seq.finish_reason is None
    assert max(tok.decoded_lengths) <= len(b"c") + 4

"""Token bitmasks: our on-device apply against a per-token reference and xgrammar's own."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kvbatch.engine.structured.bitmask import TokenBitmask, apply_token_bitmask, bitmask_words


def random_words(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(
        -(2**31), 2**31 - 1, (rows, bitmask_words(vocab)), dtype=torch.int32, generator=g
    )


def reference(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = int(words[r, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 100, 333])
def test_every_row_matches_the_reference_and_xgrammar(vocab: int) -> None:
    logits = torch.randn(5, vocab)
    words = random_words(5, vocab, seed=vocab)
    got = logits.clone()
    apply_token_bitmask(got, TokenBitmask(None, words))
    assert torch.equal(got, reference(logits, words, list(range(5))))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words)
    assert torch.equal(got, theirs)


def test_only_the_covered_rows_change() -> None:
    vocab = 70
    logits = torch.randn(6, vocab)
    words = random_words(2, vocab, seed=1)
    got = logits.clone()
    apply_token_bitmask(got, TokenBitmask(torch.tensor([1, 4]), words))
    assert torch.equal(got, reference(logits, words, [1, 4]))
    for row in (0, 2, 3, 5):
        assert torch.equal(got[row], logits[row])


def test_tokens_past_the_mask_are_forbidden() -> None:
    """A model whose logits are wider than the grammar's vocabulary never gets those ids."""
    logits = torch.zeros(1, 80)
    apply_token_bitmask(logits, TokenBitmask(None, torch.full((1, 2), -1, dtype=torch.int32)))
    assert torch.isinf(logits[0, 64:]).all() and (logits[0, :64] == 0).all()


def test_bitmask_words() -> None:
    assert [bitmask_words(v) for v in (1, 32, 33, 49152)] == [1, 1, 2, 1536]

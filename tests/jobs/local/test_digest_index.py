"""DigestIndex against a dict: the same answers through every merge, digests that end in zero
bytes (numpy's fixed-width bytes drop those when an item is read out) included."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.jobs.local.digest_index import DigestIndex, hex_key, id_number, key_of
from kvbatch.jobs.local.line_chunks import line_digest

DIGESTS = st.binary(min_size=16, max_size=16) | st.sampled_from(
    [b"\0" * 16, b"a" * 15 + b"\0", b"a" * 14 + b"\0\0", b"a" * 14 + b"\0\1", b"\0" * 15 + b"a"]
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(DIGESTS, st.integers(-(2**63), 2**63 - 1)), max_size=300),
       st.lists(DIGESTS, max_size=40), st.integers(1, 40))  # fmt: skip
def test_answers_as_a_dict_keeping_the_first_value(pairs, others, merge_every):
    index, model = DigestIndex(merge_every=merge_every), {}
    for digest, value in pairs:
        index.add(digest, value)
        model.setdefault(digest, value)
    assert len(index) == len(model)
    for digest in [d for d, _ in pairs] + others:
        assert (digest in index) == (digest in model)
        assert index.get(digest) == model.get(digest)


def test_holds_24_bytes_an_entry_once_merged():
    index = DigestIndex(merge_every=1000)
    for i in range(10_000):
        index.add(hashlib.md5(str(i).encode()).digest(), i)
    assert len(index) == 10_000
    assert index.nbytes >= 24 * 8_000 and index.nbytes <= 24 * 10_000
    assert index.get(hashlib.md5(b"1234").digest()) == 1234


def test_keys_and_numbers():
    assert hex_key(line_digest(b'{"custom_id": "a"}')) == bytes.fromhex(
        line_digest(b'{"custom_id": "a"}')
    )
    assert len(key_of("a")) == 16 and key_of("a") != key_of("b")
    assert key_of("\udcff") != key_of("\udcfe")  # a lone surrogate, as json can decode one
    assert id_number("req-1") == id_number("req-1") != id_number("req-2")
    with pytest.raises(ValueError, match="16 bytes"):
        DigestIndex().add(b"short")
    assert "text" not in DigestIndex()

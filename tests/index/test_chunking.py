"""Chunking with all-MiniLM-L6-v2's own tokenizer: sizes, where cuts fall, overlap, ids."""

from __future__ import annotations

import pytest

from kvbatch.index.chunking import Chunker
from tests.index.conftest import TIDES, VOLCANOES_MD


@pytest.fixture
def count(minilm_tokenizer):
    return lambda t: len(minilm_tokenizer.encode(t, add_special_tokens=False))


def test_no_chunk_is_longer_than_the_size_in_the_models_tokens(minilm_tokenizer, count):
    text = "\n\n".join([TIDES] * 6)
    chunks = Chunker.for_tokenizer(minilm_tokenizer, size=40, overlap=8).chunk("t.txt", text)
    assert len(chunks) > 6
    assert all(count(c.text) <= 40 for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_sections_are_packed_whole_and_cut_at_headings_first(minilm_tokenizer, count):
    # the sections have 20, 37 and 27 tokens: the first two fit in 62 together, the third not
    chunker = Chunker.for_tokenizer(minilm_tokenizer, size=62, overlap=0)
    texts = chunker.split(VOLCANOES_MD)
    assert len(texts) == 2 and all(count(t) <= 62 for t in texts)
    # every chunk starts at a heading: no section was cut, none straddles two headings' halves
    assert all(t.startswith("#") for t in texts), texts
    assert texts[0].startswith("# Volcanoes") and "## How magma forms" in texts[0]
    assert texts[-1].startswith("## Kinds of eruption")
    whole = Chunker.for_tokenizer(minilm_tokenizer, size=500, overlap=0).split(VOLCANOES_MD)
    assert whole == [VOLCANOES_MD.strip()]


def test_a_long_section_is_cut_at_sentences_with_the_overlap(minilm_tokenizer):
    sentences = [f"Sentence number {i} tells about the sea and the moon." for i in range(30)]
    text = " ".join(sentences)
    pieces = Chunker.for_tokenizer(minilm_tokenizer, size=40, overlap=10).split(text)
    assert len(pieces) > 3
    for a, b in zip(pieces, pieces[1:]):  # consecutive pieces share words
        assert set(a.split()[-4:]) & set(b.split()[:8])


def test_chunk_ids_follow_the_text_not_the_position(minilm_tokenizer):
    chunker = Chunker.for_tokenizer(minilm_tokenizer, size=45, overlap=0)
    before = chunker.chunk("v.md", VOLCANOES_MD)
    preface = "# Preface\n\n" + "A new first section, long enough to be a chunk of its own. " * 2
    edited = chunker.chunk("v.md", preface + "\n\n" + VOLCANOES_MD)
    assert len(edited) == len(before) + 1
    # every chunk keeps its id though each moved one place down
    assert [c.chunk_id for c in edited[1:]] == [c.chunk_id for c in before]
    assert [c.index for c in edited[1:]] == [c.index + 1 for c in before]
    other = chunker.chunk("other.md", VOLCANOES_MD)  # the same text in another document
    assert not {c.chunk_id for c in before} & {c.chunk_id for c in other}


def test_identical_chunks_of_one_document_get_distinct_ids_in_order(minilm_tokenizer):
    text = "# Note\n\nThe same disclaimer.\n\n# Body\n\nSomething else.\n\n# Note\n\nThe same disclaimer."
    chunks = Chunker.for_tokenizer(minilm_tokenizer, size=8, overlap=0).chunk("d.md", text)
    texts = [c.text for c in chunks]
    assert texts[0] == texts[-1]
    assert len({c.chunk_id for c in chunks}) == len(chunks)
    again = Chunker.for_tokenizer(minilm_tokenizer, size=8, overlap=0).chunk("d.md", text)
    assert [c.chunk_id for c in again] == [c.chunk_id for c in chunks]

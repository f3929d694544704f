"""The stdlib retrieval corpus: deterministic, the query removed from its page, skips counted."""

from __future__ import annotations

import sys

import pytest

from kvbatch.bench.stdlib_corpus import build_corpus, cut, page_without, stdlib_modules


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(limit=12, max_chars=1500)


def test_the_modules_are_sorted_public_and_free_of_side_effects():
    names = stdlib_modules()
    assert names == sorted(names) and "json" in names and "email.mime.text" in names
    assert not any(part.startswith("_") for n in names for part in n.split("."))
    assert "antigravity" not in names and "this" not in names
    assert not any(n.startswith(("encodings.", "distutils.", "test.")) for n in names)


def test_the_corpus_is_deterministic_and_no_page_holds_its_query(corpus):
    again = build_corpus(limit=12, max_chars=1500)
    assert again.fingerprint == corpus.fingerprint and len(corpus.documents) == 12
    assert [d.module for d in corpus.documents] == sorted(d.module for d in corpus.documents)
    for d in corpus.documents:
        assert d.summary and d.summary not in d.text and len(d.text) <= 1500
        assert d.document_id == f"{d.module}.txt"
        assert sys.prefix not in d.text  # the FILE section (a local path) is dropped
        assert " at 0x" not in d.text
    assert len({d.summary for d in corpus.documents}) == 12
    assert "skipped" in corpus.describe() and corpus.python in corpus.describe()


def test_the_skips_are_counted(corpus):
    # abc's docstring has its summary; array's first docstring line runs on, so no summary
    skipped = corpus.no_summary + corpus.failed_import + corpus.summary_kept + corpus.summary_taken
    assert "array" in corpus.no_summary
    used = {d.module for d in corpus.documents}
    considered = [m for m in stdlib_modules() if m <= max(used)]
    assert sorted(used | set(skipped)) == considered


def test_the_pages_are_written_one_file_each(corpus, tmp_path):
    folder = corpus.write(tmp_path / "c")
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(d.document_id for d in corpus.documents)
    d = corpus.documents[0]
    assert (folder / d.document_id).read_text(encoding="utf-8") == d.text + "\n"


def test_a_wrapped_summary_is_refused_and_cut_keeps_whole_lines():
    assert page_without("one two", "x one\ntwo y") is None
    assert page_without("one two", "NAME\n  m - one two\nrest") == "NAME\n  m - \nrest"
    assert cut("aaa\nbbb\nccc", 9) == "aaa\nbbb"
    assert cut("short", 100) == "short"
    with pytest.raises(ValueError, match="max_chars"):
        build_corpus(limit=1, max_chars=10)


def test_min_chars_keeps_long_pages_only_and_counts_the_rest():
    long = build_corpus(limit=4, max_chars=9000, min_chars=6000)
    assert len(long.documents) == 4 and long.too_short
    assert all(6000 <= len(d.text) <= 9000 for d in long.documents)
    used = {d.module for d in long.documents}
    skipped = long.no_summary + long.failed_import + long.summary_kept + long.summary_taken
    considered = [m for m in stdlib_modules() if m <= max(used)]
    assert sorted(used | set(skipped) | set(long.too_short)) == considered
    assert "pages of at least 6000" in long.describe() and long.to_dict()["min_chars"] == 6000
    with pytest.raises(ValueError, match="min_chars"):
        build_corpus(limit=1, max_chars=1000, min_chars=2000)

"""Listing a folder by globs, and reading documents: the size limit before any read."""

from __future__ import annotations

import pytest

from kvbatch.index.sources import (
    DocumentError,
    SourceDocument,
    SourceError,
    list_documents,
    read_document,
)
from kvbatch.index.spec import SourceSpec


def test_listing_follows_the_globs_sorted_by_key_and_skips_links(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.md", "a.txt", "sub/c.html", "sub/d.pdf", "notes.docx", "drafts.md"):
        (tmp_path / name).write_text("x")
    (tmp_path / "link.md").symlink_to(tmp_path / "b.md")
    found = list_documents(SourceSpec(uri=str(tmp_path), exclude=("drafts*",)))
    assert [d.id for d in found] == ["a.txt", "b.md", "sub/c.html", "sub/d.pdf"]
    assert found[2].uri == str(tmp_path / "sub" / "c.html") and found[2].size == 1


def test_a_missing_folder_stops_the_run(tmp_path):
    with pytest.raises(SourceError, match="source.path"):
        list_documents(SourceSpec(uri=str(tmp_path / "absent")))


def test_a_200_mb_document_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 200 MB on the listing, no disk
        f.truncate(200 * 1024 * 1024)
    (doc,) = list_documents(SourceSpec(uri=str(tmp_path)))
    with pytest.raises(DocumentError) as e:
        read_document(doc, max_bytes=50 * 1024 * 1024)
    assert e.value.code == "too_large" and "209715200 bytes" in str(e.value)


def test_a_document_that_grew_past_the_limit_after_listing_is_refused(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"x" * 100)
    doc = SourceDocument("a.txt", str(path), 10)
    with pytest.raises(DocumentError, match="more than source.max_bytes"):
        read_document(doc, max_bytes=50)


def test_an_unreadable_document_is_an_error_naming_it(tmp_path):
    doc = SourceDocument("gone.txt", str(tmp_path / "gone.txt"), 3)  # removed after listing
    with pytest.raises(DocumentError) as e:
        read_document(doc, max_bytes=100)
    assert e.value.code == "unreadable" and "gone.txt" in e.value.record("gone.txt").message


@pytest.mark.parametrize("spec", [{"include": ("*.mdx",)}, {"exclude": ("*",)}, {}])
def test_a_listing_that_matches_nothing_stops_the_run(tmp_path, spec):
    """A glob typo (or an emptied folder) would otherwise delete every row of the index."""
    if spec:
        (tmp_path / "a.md").write_text("x")
    with pytest.raises(SourceError, match=r"source: none of the \d files .*source.include"):
        list_documents(SourceSpec(uri=str(tmp_path), **spec))

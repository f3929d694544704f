"""parse_document on real files of each format, read by the real parsers (trafilatura, pypdf),
and the documents it refuses."""

from __future__ import annotations

import pytest

from kvbatch.index.parse import parse_document
from kvbatch.index.sources import DocumentError
from tests.index.conftest import CORALS, LIGHTHOUSES_HTML, TIDES, VOLCANOES_MD, write_pdf


def test_text_and_markdown_are_kept_as_written():
    assert parse_document("a/tides.txt", TIDES.encode()) == TIDES
    assert parse_document("volcanoes.md", VOLCANOES_MD.encode()) == VOLCANOES_MD.strip()


def test_html_keeps_the_article_as_markdown_and_drops_the_boilerplate():
    text = parse_document("lighthouses.html", LIGHTHOUSES_HTML.encode())
    assert "# Lighthouses" in text and "## The Fresnel lens" in text
    assert "Augustin-Jean Fresnel designed a lens" in text
    assert "Shop our merchandise" not in text and "Cookie settings" not in text
    assert "<p>" not in text


def test_pdf_text_comes_out_of_a_real_pdf(tmp_path):
    data = write_pdf(tmp_path / "c.pdf", CORALS).read_bytes()
    text = " ".join(parse_document("c.pdf", data).split())
    assert text.startswith("Coral reefs")
    for paragraph in CORALS:
        assert paragraph in text


@pytest.mark.parametrize(
    ("name", "data", "code"),
    [
        ("empty.txt", b"", "empty"),
        ("blank.md", b"  \n\n\t ", "empty"),
        ("image.txt", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "binary"),
        ("latin1.txt", "café crème".encode("latin-1"), "unparsable"),
        ("broken.pdf", b"%PDF-1.4\nthis is not a pdf body", "unparsable"),
        ("bare.html", b"<html><head><title>t</title></head><body></body></html>", "empty"),
    ],
)
def test_a_document_without_usable_text_is_an_error_that_says_why(name, data, code):
    with pytest.raises(DocumentError) as e:
        parse_document(name, data)
    assert e.value.code == code
    record = e.value.record(name)
    assert record.document_id == name and name in record.message

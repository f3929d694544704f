"""parse_document on real files of each format, read by the real parsers (trafilatura, pypdf),
and the documents it refuses."""

from __future__ import annotations

import io
import logging

import pypdf
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


SMALL_PAGE = """<html><head><title>Kettles</title></head><body>
<nav><a href="/">Home</a> | <a href="/blog">Blog archive</a> | <a href="/about">About us</a></nav>
<header><p>Kitchen Notes, the site banner</p></header>
<p>Fill the kettle halfway with equal parts water and white vinegar, boil it, and leave it.</p>
<aside>Related: toasters</aside><footer>All rights reserved</footer></body></html>"""
ARTICLE = """<html><body><article><header><h1>Descaling</h1></header>
<p>Boil water and vinegar in the kettle, then rinse it twice with clean water.</p>
<footer>Written by the kitchen team</footer></article><footer>Site map</footer></body></html>"""


def test_a_small_page_keeps_no_menu_banner_sidebar_or_footer():
    """On a short page trafilatura falls back to its baseline extractor, which keeps every
    text: the site's chrome is dropped before it."""
    text = parse_document("kettles.html", SMALL_PAGE.encode())
    assert text == (
        "Fill the kettle halfway with equal parts water and white vinegar, boil it, and leave it."
    )
    article = parse_document("descaling.html", ARTICLE.encode())
    assert "Descaling" in article and "rinse it twice" in article  # the article's own header
    assert "Site map" not in article


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


def _encrypted(tmp_path, user_password: str) -> bytes:
    """A real PDF (fpdf2) encrypted by pypdf with `user_password`."""
    reader = pypdf.PdfReader(write_pdf(tmp_path / "plain.pdf", CORALS))
    writer = pypdf.PdfWriter()
    for page in reader.pages:
        writer.add_page(page)
    writer.encrypt(user_password=user_password, owner_password="owner")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_a_password_protected_pdf_is_an_error_that_says_so(tmp_path):
    with pytest.raises(DocumentError) as e:
        parse_document("locked.pdf", _encrypted(tmp_path, "secret"))
    assert e.value.code == "encrypted" and "password-protected" in str(e.value)


def test_a_pdf_encrypted_with_an_empty_password_is_read(tmp_path):
    text = " ".join(parse_document("open.pdf", _encrypted(tmp_path, "")).split())
    assert CORALS[0] in text


def test_html_of_scripts_only_is_an_error_and_logs_nothing_else(caplog):
    html = b"<html><head><script>var a = 1;</script></head><body><script>f()</script></body></html>"
    with caplog.at_level(logging.WARNING), pytest.raises(DocumentError) as e:
        parse_document("scripts.html", html)
    assert e.value.code == "empty" and not caplog.records

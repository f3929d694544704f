"""Bytes to text, by the document's suffix, with maintained parsers:

- Markdown and plain text are decoded as UTF-8 and kept as they are (Markdown's headings are
  what the chunker cuts at first).
- HTML goes through trafilatura, which drops navigation, footers and other boilerplate (what
  a web page carries besides its text) and writes the rest as Markdown, headings included.
  On a short page trafilatura falls back to a baseline extractor that keeps every text, so
  the page's nav and aside elements, and its header and footer outside the article (or
  main), are removed first: a menu never reads as part of the document.
- PDF goes through pypdf (pure Python, no native dependencies), page texts joined by blank lines.

A file that is not what its suffix says (NUL bytes in "text", a PDF pypdf cannot read), or
that holds no text, raises DocumentError naming why.
"""

from __future__ import annotations

import io
import logging

import lxml.etree
import lxml.html
import pypdf
import trafilatura

from kvbatch.index.sources import DocumentError

HTML_SUFFIXES = (".html", ".htm")
PDF_SUFFIXES = (".pdf",)

# pypdf logs every recoverable flaw of a file at WARNING; an index run reads thousands.
logging.getLogger("pypdf").setLevel(logging.ERROR)
# trafilatura logs a page it finds no text in ("discarding data: None"); that page is an
# error record already.
logging.getLogger("trafilatura").setLevel(logging.ERROR)


def parse_document(document_id: str, data: bytes) -> str:
    """The document's text; DocumentError (stage "parse") when it has none or is not readable
    as its suffix says."""
    name = document_id.lower()
    if name.endswith(PDF_SUFFIXES):
        text = _pdf_text(data)
    elif name.endswith(HTML_SUFFIXES):
        text = _html_text(_decode(data))
    else:
        text = _decode(data)
    text = text.strip()
    if not text:
        raise DocumentError("parse", "empty", "no text in it")
    return text


def _decode(data: bytes) -> str:
    if b"\0" in data[:8192]:
        raise DocumentError("parse", "binary", "a binary file (NUL bytes), not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DocumentError(
            "parse", "unparsable", f"not UTF-8 text (byte {e.start}): convert it to UTF-8"
        ) from e


# a site's menus, banners and sidebars; an article's own header (its title) and footer stay
_BOILERPLATE = (
    "//nav | //aside | //*[@role='navigation'] | "
    "//header[not(ancestor::article or ancestor::main)] | "
    "//footer[not(ancestor::article or ancestor::main)]"
)


def _html_text(html: str) -> str:
    text = trafilatura.extract(
        _without_boilerplate(html),
        output_format="markdown",
        include_formatting=True,
        include_tables=True,
        include_comments=False,
        favor_recall=True,
    )
    return text or ""


def _without_boilerplate(html: str):
    """The page's tree without its navigation and site chrome (_BOILERPLATE); the page as it
    is when lxml cannot parse it (trafilatura then tries)."""
    try:
        tree = lxml.html.document_fromstring(html.encode("utf-8"))
    except (lxml.etree.ParserError, ValueError):
        return html
    for element in tree.xpath(_BOILERPLATE):
        if element.getparent() is not None:
            element.drop_tree()
    return tree


def _pdf_text(data: bytes) -> str:
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
    except Exception as e:  # pypdf raises many kinds on a damaged file
        raise DocumentError("parse", "unparsable", f"not a readable PDF: {e}") from e
    if reader.is_encrypted and not _opens_without_password(reader):
        raise DocumentError(
            "parse", "encrypted", "a password-protected PDF: save it without a password"
        )
    try:
        pages = [page.extract_text() or "" for page in reader.pages]
    except Exception as e:  # pypdf raises many kinds on a damaged file
        raise DocumentError("parse", "unparsable", f"not a readable PDF: {e}") from e
    return "\n\n".join(p.strip() for p in pages if p.strip())


def _opens_without_password(reader: pypdf.PdfReader) -> bool:
    """An encrypted PDF with an empty user password (only its permissions locked) opens."""
    try:
        return bool(reader.decrypt(""))
    except Exception:  # an encryption pypdf cannot undo
        return False

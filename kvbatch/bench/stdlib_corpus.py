"""A retrieval corpus with known answers that nobody here wrote and that is on every machine:
the Python standard library's own documentation.

Each public top-level stdlib module (sorted `sys.stdlib_module_names`) becomes one document:
pydoc's plain-text page of it (`pydoc.render_doc(module, renderer=pydoc.plaintext)`). Its
query is the module's one-line summary, as pydoc itself finds it (`pydoc.splitdoc`: the first
line of the docstring when a blank line follows it), and the relevant document is the
module's own page with every copy of that line removed (pydoc writes it twice: in NAME and
at the top of DESCRIPTION), so a query never matches its answer verbatim.

The page is made machine-independent and safe to write out: the FILE section (a local path)
and the DATA section (module-level values: `os.environ` is one) are dropped, and object
addresses (`at 0x7f...`) are removed. Pages are cut at a line boundary to `max_chars`, so a
long page (os, typing) stays within what the generation model reads at once.

A module is skipped when it fails to import, when pydoc finds no summary, or when the
summary survives removal (it is not one line of the page); the corpus says how many of each.
The same Python version gives the same corpus: `fingerprint` names it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import pkgutil
import pydoc
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

SIDE_EFFECTS = frozenset({"antigravity", "this", "idlelib", "turtledemo", "__phello__"})
"""Modules whose import does something (opens a browser, prints, starts a GUI demo)."""

NOT_WALKED = frozenset({"test", "distutils", "encodings", "lib2to3"})
"""Packages whose submodules are left out: the test suite; distutils, which setuptools
replaces by its own copy in some environments (not the same corpus everywhere); and the
codec and fixer modules, hundreds of near-identical pages."""

DROPPED_SECTIONS = frozenset({"FILE", "DATA", "MODULE REFERENCE"})
"""pydoc page sections left out: a local path, module-level values (os.environ is one) and
the boilerplate pointing to docs.python.org that every page carries."""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SECTION = re.compile(r"^[A-Z][A-Z ]+$")


@dataclass(frozen=True)
class StdlibDocument:
    module: str
    summary: str  # the query
    text: str  # the page, the summary removed

    @property
    def document_id(self) -> str:
        """Its key under the corpus folder (what the index calls its document id)."""
        return f"{self.module}.txt"


@dataclass
class StdlibCorpus:
    documents: list[StdlibDocument]
    python: str = field(default_factory=lambda: sys.version.split()[0])
    failed_import: list[str] = field(default_factory=list)
    no_summary: list[str] = field(default_factory=list)
    summary_kept: list[str] = field(default_factory=list)
    summary_taken: list[str] = field(default_factory=list)  # an earlier module has that summary
    too_short: list[str] = field(default_factory=list)  # pages under min_chars
    max_chars: int = 0
    min_chars: int = 0

    @property
    def fingerprint(self) -> str:
        """sha256 (12 hex) over every document's id, query and text: equal corpora, equal value."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(f"{d.document_id}\0{d.summary}\0{d.text}\0".encode())
        return h.hexdigest()[:12]

    def describe(self) -> str:
        return (
            f"Python {self.python} stdlib pydoc pages: {len(self.documents)} modules "
            f"(cut to {self.max_chars} characters"
            + (f", pages of at least {self.min_chars}" if self.min_chars else "")
            + f"; skipped: {len(self.failed_import)} failed "
            f"to import, {len(self.no_summary)} without a one-line summary, "
            f"{len(self.summary_kept)} whose summary is not one line of the page, "
            f"{len(self.summary_taken)} whose summary an earlier module has"
            + (f", {len(self.too_short)} shorter" if self.min_chars else "")
            + "), "
            f"fingerprint {self.fingerprint}"
        )

    def write(self, folder: Path) -> Path:
        """One `MODULE.txt` per document in `folder` (created); returns it."""
        folder.mkdir(parents=True, exist_ok=True)
        for d in self.documents:
            (folder / d.document_id).write_text(d.text + "\n", encoding="utf-8")
        return folder

    def to_dict(self) -> dict[str, object]:
        return {
            "python": self.python,
            "documents": len(self.documents),
            "max_chars": self.max_chars,
            "min_chars": self.min_chars,
            "too_short": len(self.too_short),
            "fingerprint": self.fingerprint,
            "failed_import": self.failed_import,
            "no_summary": len(self.no_summary),
            "summary_kept": self.summary_kept,
            "summary_taken": self.summary_taken,
        }


def stdlib_modules() -> list[str]:
    """The public stdlib modules and their public submodules (packages walked but those of
    NOT_WALKED), sorted; no `_private` ones, none with side effects on import."""
    top = sorted(
        m for m in sys.stdlib_module_names if not m.startswith("_") and m not in SIDE_EFFECTS
    )
    names = set(top)
    for name in top:
        if name in NOT_WALKED:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for info in pkgutil.walk_packages(spec.submodule_search_locations, f"{name}.", _ignore):
            if not any(p.startswith("_") or p in ("test", "tests") for p in info.name.split(".")):
                names.add(info.name)
    return sorted(names)


def _ignore(_name: str) -> None:
    """walk_packages' onerror: a subpackage that fails to import is not walked."""


def build_corpus(
    limit: int | None = None, max_chars: int = 4000, min_chars: int = 0
) -> StdlibCorpus:
    """The first `limit` usable modules (all with None) in sorted order, pages cut to
    `max_chars` characters; pages shorter than `min_chars` are skipped (a corpus of long
    documents only)."""
    if max_chars < 200:
        raise ValueError(f"max_chars must be >= 200, got {max_chars}")
    if min_chars > max_chars:
        raise ValueError(f"min_chars ({min_chars}) must not exceed max_chars ({max_chars})")
    corpus = StdlibCorpus(documents=[], max_chars=max_chars, min_chars=min_chars)
    summaries: set[str] = set()
    with _quiet():
        names = stdlib_modules()
    for name in names:
        if limit is not None and len(corpus.documents) >= limit:
            break
        module = _quiet_import(name)
        if module is None:
            corpus.failed_import.append(name)
            continue
        summary, _ = pydoc.splitdoc(pydoc.getdoc(module))
        summary = summary.strip()
        if not summary:
            corpus.no_summary.append(name)
            continue
        if summary in summaries:  # one query, one relevant document
            corpus.summary_taken.append(name)
            continue
        text = page_without(summary, _page(module))
        if text is None:
            corpus.summary_kept.append(name)
            continue
        if len(text) < min_chars:
            corpus.too_short.append(name)
            continue
        summaries.add(summary)
        corpus.documents.append(StdlibDocument(name, summary, cut(text, max_chars)))
    return corpus


def page_without(summary: str, page: str) -> str | None:
    """The page with every line that holds the summary emptied of it (None when some copy
    of it remains, e.g. wrapped over two lines)."""
    text = page.replace(summary, "")
    if summary in text or summary in " ".join(text.split()):
        return None
    return text


def cut(text: str, max_chars: int) -> str:
    """The text's lines, as many whole ones as fit in `max_chars` (at least the first part)."""
    if len(text) <= max_chars:
        return text.rstrip()
    head = text[:max_chars]
    return (head[: head.rfind("\n")] if "\n" in head else head).rstrip()


def _page(module) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = pydoc.render_doc(module, renderer=pydoc.plaintext)
    lines, dropping = [], False
    for line in raw.splitlines():
        if _SECTION.match(line):
            dropping = line.strip() in DROPPED_SECTIONS
        if not dropping:
            lines.append(_ADDRESS.sub("", line.rstrip()))
    return "\n".join(lines)


@contextlib.contextmanager
def _quiet():
    """What imports print and warn is swallowed."""
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        yield


def _quiet_import(name: str):
    """The module, or None when importing it fails."""
    with _quiet():
        try:
            return importlib.import_module(name)
        except BaseException:  # SystemExit too: a module may exit on import
            return None

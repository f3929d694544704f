"""Write examples/docs/coral_reefs.pdf, the example PDF document of `kvbatch index`, with fpdf2
(a maintained PDF writer): run it again to regenerate the file after editing the text."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from fpdf import FPDF

TITLE = "Coral reefs"
PARAGRAPHS = [
    "Coral reefs are ridges built over thousands of years by colonies of tiny animals called "
    "coral polyps. Each polyp takes calcium and carbonate from sea water and lays down a hard "
    "skeleton of limestone, and the skeletons of countless generations pile up into a reef.",
    "Most reef-building corals live in partnership with microscopic algae that grow inside their "
    "tissues. The algae use sunlight to make sugars and share them with the coral, which is why "
    "reefs grow only in clear, shallow and warm tropical water where light reaches the bottom.",
    "When the water stays too warm for too long, corals expel their algae and turn white, an event "
    "called coral bleaching. A bleached coral is not dead, but it starves if the algae do not "
    "return within a few weeks. The Great Barrier Reef off Australia, the largest reef system on "
    "Earth, has suffered several mass bleaching events since 1998.",
]


def write_pdf(path: Path) -> Path:
    pdf = FPDF()
    # a fixed date: the same bytes on every run, so the index sees no change
    pdf.set_creation_date(datetime(2024, 1, 1, tzinfo=timezone.utc))
    pdf.add_page()
    pdf.set_font("Helvetica", style="B", size=16)
    pdf.cell(0, 10, TITLE, new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", size=11)
    for paragraph in PARAGRAPHS:
        pdf.multi_cell(0, 6, paragraph)
        pdf.ln(4)
    pdf.output(str(path))
    return path


if __name__ == "__main__":
    print(
        write_pdf(Path(__file__).resolve().parent.parent / "examples" / "docs" / "coral_reefs.pdf")
    )

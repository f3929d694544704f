"""Aligned plain-text tables for the bench reports (standard library only: the GPU check's
summary script uses it too)."""

from __future__ import annotations

from collections.abc import Sequence


def format_rows(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as aligned text: the first column left-aligned, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return out

"""The production image carries the installed package's folders and nothing else: no tests,
no one-off studies (studies/), no scripts."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_copies_exactly_the_package_folders():
    copied = re.findall(r"^COPY (\S+) \./\S*$", (ROOT / "Dockerfile").read_text(), re.M)
    folders = {c.rstrip("/") for c in copied if (ROOT / c).is_dir()}
    assert folders == {"kvbatch"}
    assert "studies" not in folders and (ROOT / "studies").is_dir()

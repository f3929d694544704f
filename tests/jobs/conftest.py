"""Fixtures of the jobs tests that run a long-context model without --max-model-len."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

LONG_CONTEXT = 32768  # what the long-context copy's config says


@pytest.fixture(scope="module")
def long_context_chat_model(tiny_chat_model: Path, tmp_path_factory) -> Path:
    """The tiny chat Llama (SmolLM2's tokenizer) whose config says 32k positions."""
    path = tmp_path_factory.mktemp("long_chat") / "model"
    shutil.copytree(tiny_chat_model, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path

"""`kvbatch index` and `kvbatch search` as a user runs them, on examples/index.toml over
examples/docs (the models swapped for the test's: a tiny chat model and all-MiniLM-L6-v2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbatch.cli import main
from kvbatch.index.spec import load_spec

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_example_spec_names_the_models_make_fetches():
    spec = load_spec(EXAMPLES / "index.toml")
    root = EXAMPLES.parent
    assert spec.source.uri == str(EXAMPLES / "docs")
    assert spec.models.generation == str(root / "models" / "SmolLM2-135M-Instruct")
    assert spec.models.embedding == str(root / "models" / "all-MiniLM-L6-v2")
    assert spec.output.uri == str(root / "out" / "index")
    names = {p.suffix for p in (EXAMPLES / "docs").iterdir()}
    assert {".txt", ".md", ".html", ".pdf"} <= names


def test_index_then_search_the_examples(tmp_path, tiny_chat_model, minilm, capsys):
    text = (EXAMPLES / "index.toml").read_text()
    text = text.replace("../models/SmolLM2-135M-Instruct", str(tiny_chat_model))
    text = text.replace("../models/all-MiniLM-L6-v2", str(minilm))
    text = text.replace("max_tokens = 48", "max_tokens = 6")
    examples = tmp_path / "examples"  # the spec's paths are relative to its folder
    shutil.copytree(EXAMPLES / "docs", examples / "docs")
    (examples / "index.toml").write_text(text)
    report_file = tmp_path / "report.json"
    assert main(["index", str(examples / "index.toml"), "--report", str(report_file)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents_parsed"] == 6 and summary["errors"] == 0 and summary["wrote"]
    report = json.loads(report_file.read_text())
    assert report["prefill"]["computed"] == report["prefill"]["ideal"]
    index = tmp_path / "out" / "index"  # output.uri = "../out/index", from the spec's folder
    assert main(["search", str(index), "how do tides form", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1. tides.txt  score ") and "2. " in out
    # the second run finds nothing to do
    assert main(["index", str(examples / "index.toml")]) == 0
    assert json.loads(capsys.readouterr().out)["wrote"] is False


def test_a_spec_error_exits_2_naming_the_field(tmp_path, capsys):
    spec = "[source]\npath = 'docs'\n[models]\nembedding = 'e'\n[output]\nuri = 'i'\n"
    (tmp_path / "index.toml").write_text(spec)
    assert main(["index", str(tmp_path / "index.toml")]) == 2
    assert "kvbatch index: models.generation: required" in capsys.readouterr().err


def test_search_of_a_missing_index_says_to_run_index(tmp_path, capsys):
    assert main(["search", str(tmp_path / "none"), "q"]) == 2
    assert "run `kvbatch index` first" in capsys.readouterr().err


def test_an_error_record_is_one_line_whatever_the_file_name(tmp_path, minilm, capsys):
    """A file name may hold a newline or an escape sequence: its error line stays one line."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ok.txt").write_text("Tides rise and fall twice a day.")
    (docs / "new\nline\x1b[2J.txt").write_text("")  # empty: an error record
    spec = tmp_path / "index.toml"
    spec.write_text(
        f'[source]\npath = "{docs}"\n[models]\nembedding = "{minilm}"\n[stages]\n'
        f'context = false\n[output]\nuri = "{tmp_path / "index"}"\n[engine]\ndevice = "cpu"\n'
    )
    assert main(["index", str(spec)]) == 0
    errors = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert errors == [r"kvbatch index: error: new\nline\x1b[2J.txt: no text in it (parse, empty)"]

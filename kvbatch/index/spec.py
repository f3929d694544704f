"""The index spec: one TOML file says what to read, how to cut it, what to generate and where
the rows go (docs/INDEXING.md shows every field). Loading checks every field and an error names
it (`stages.questions.n: expected an integer >= 1, got "three"`), so a nightly run fails at once
on a typo instead of after the models loaded."""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from kvbatch.hub import ModelNotFoundError, split_hub_id
from kvbatch.index.prompts import CONTEXT_PROMPT, QUESTIONS_PROMPT, SUMMARY_PROMPT

DEFAULT_INCLUDE = ("*.md", "*.markdown", "*.txt", "*.html", "*.htm", "*.pdf")
DEFAULT_MAX_BYTES = 50 * 1024 * 1024


class SpecError(ValueError):
    """The spec file is missing, not TOML, or a field is wrong; the message names the field."""


@dataclass(frozen=True)
class SourceSpec:
    uri: str  # a local folder (resolved against the spec's folder) or s3://bucket/prefix
    include: tuple[str, ...] = DEFAULT_INCLUDE  # fnmatch patterns over keys ('*' crosses '/')
    exclude: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_BYTES  # a larger document is an error record, never read


@dataclass(frozen=True)
class ChunkingSpec:
    size: int = 256  # tokens of the embedding model's tokenizer
    overlap: int = 0  # tokens shared by consecutive chunks


@dataclass(frozen=True)
class ModelsSpec:
    embedding: str  # a folder or Hub id; its tokenizer also measures chunks
    generation: str | None = None  # needed when context, questions or summary runs
    embedding_revision: str | None = None
    generation_revision: str | None = None


@dataclass(frozen=True)
class ContextStage:
    max_tokens: int = 100
    prompt: str = CONTEXT_PROMPT  # {document} and {chunk}


@dataclass(frozen=True)
class QuestionsStage:
    n: int = 3
    max_tokens: int = 128
    prompt: str = QUESTIONS_PROMPT  # {document}, {chunk} and {n}


@dataclass(frozen=True)
class SummaryStage:
    max_tokens: int = 128
    prompt: str = SUMMARY_PROMPT  # {document}


@dataclass(frozen=True)
class StagesSpec:
    context: ContextStage | None = field(default_factory=ContextStage)
    questions: QuestionsStage | None = None
    summary: SummaryStage | None = None
    embed: bool = True

    @property
    def generates(self) -> bool:
        return any(s is not None for s in (self.context, self.questions, self.summary))


@dataclass(frozen=True)
class OutputSpec:
    uri: str  # LanceDB: a local folder or s3://bucket/prefix
    runs: str  # local folder of the run folders (stage jobs, Parquet rows, manifest)
    table: str = "chunks"


@dataclass(frozen=True)
class IndexSpec:
    source: SourceSpec
    models: ModelsSpec
    output: OutputSpec
    chunking: ChunkingSpec = field(default_factory=ChunkingSpec)
    stages: StagesSpec = field(default_factory=StagesSpec)
    engine: dict[str, Any] = field(default_factory=dict)  # kvbatch.engine.LLM keywords
    prompt_version: str = ""  # default: a digest of the prompts and stage settings in use

    @property
    def effective_prompt_version(self) -> str:
        """What a row's prompt_version says: the spec's name for it, or a digest of every
        prompt and stage setting that changes generated text, so an edit marks rows stale."""
        if self.prompt_version:
            return self.prompt_version
        stages = asdict(self.stages)
        digest = hashlib.sha256(json.dumps(stages, sort_keys=True).encode()).hexdigest()
        return "p-" + digest[:12]


def load_spec(path: str | Path) -> IndexSpec:
    """Read and check an index spec; relative local paths are taken from the spec's folder."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise SpecError(f"{path}: no such spec file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read the spec: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML: {e}") from e
    return parse_spec(raw, base=path.parent)


def parse_spec(raw: dict[str, Any], base: Path = Path(".")) -> IndexSpec:
    """An IndexSpec from a TOML table (a spec file's, or a schedule entry's `[jobs.index]`)."""
    t = _Table(raw, "")
    t.only("source", "chunking", "stages", "models", "output", "engine", "prompt_version")
    src = t.table("source", required=True)
    src.only("path", "include", "exclude", "max_bytes")
    path = src.string("path", required=True)
    _s3_bucket("source.path", path)
    source = SourceSpec(
        uri=_local_or_s3(path, base),
        include=tuple(src.strings("include", DEFAULT_INCLUDE, nonempty=True)),
        exclude=tuple(src.strings("exclude", ())),
        max_bytes=src.integer("max_bytes", DEFAULT_MAX_BYTES, minimum=1),
    )
    ch = t.table("chunking")
    ch.only("size", "overlap")
    size = ch.integer("size", 256, minimum=8)
    overlap = ch.integer("overlap", 0, minimum=0)
    if overlap >= size:
        raise SpecError(f"chunking.overlap: {overlap} must be less than chunking.size ({size})")
    st = t.table("stages")
    st.only("context", "questions", "summary", "embed")
    stages = StagesSpec(
        context=_stage(st, "context", ContextStage, default_on=not st.given),
        questions=_stage(st, "questions", QuestionsStage, default_on=False),
        summary=_stage(st, "summary", SummaryStage, default_on=False),
        embed=_embed_on(st),
    )
    m = t.table("models", required=True)
    m.only("embedding", "generation", "embedding_revision", "generation_revision")
    generation = m.string("generation")
    if stages.generates and generation is None:
        raise SpecError(
            "models.generation: required when stages context, questions or summary run "
            "(a folder or Hub id of a chat model)"
        )
    models = ModelsSpec(
        embedding=_model(m.string("embedding", required=True), base),
        generation=_model(generation, base) if generation else None,
        embedding_revision=m.string("embedding_revision"),
        generation_revision=m.string("generation_revision"),
    )
    out = t.table("output", required=True)
    out.only("uri", "runs", "table")
    uri = out.string("uri", required=True)
    _s3_bucket("output.uri", uri)
    uri = _local_or_s3(uri, base)
    runs = out.string("runs")
    if runs is None and uri.startswith("s3://"):
        raise SpecError("output.runs: required when output.uri is on S3 (a local folder)")
    runs = _local(runs, base) if runs else uri.rstrip("/") + ".runs"
    if runs.startswith("s3://"):
        raise SpecError(f"output.runs: {runs!r} must be a local folder (stage jobs resume there)")
    _outside_source(source.uri, {"output.uri": uri, "output.runs": runs})
    for name, value in (("output.uri", uri), ("output.runs", runs)):
        if not value.startswith("s3://") and Path(value).exists() and not Path(value).is_dir():
            raise SpecError(f"{name}: {value} is a file; name a folder (it is created if absent)")
    table = out.string("table", "chunks")
    if not table.replace("_", "").replace("-", "").isalnum():
        raise SpecError(f"output.table: {table!r}: use letters, digits, '_' and '-' only")
    engine = t.table("engine").raw
    return IndexSpec(
        source=source,
        models=models,
        output=OutputSpec(uri=uri, runs=runs, table=table),
        chunking=ChunkingSpec(size=size, overlap=overlap),
        stages=stages,
        engine=dict(engine),
        prompt_version=t.string("prompt_version", ""),
    )


def _stage(st: _Table, name: str, kind: type, default_on: bool):
    """A stage runs when its table is present (`[stages.context]`) unless `enabled = false`;
    `context = true/false` is the short form."""
    value = st.raw.get(name)
    if value is None:
        return kind() if default_on else None
    if isinstance(value, bool):
        return kind() if value else None
    sub = st.table(name)
    allowed = ["enabled", *kind.__dataclass_fields__]
    sub.only(*allowed)
    if not sub.boolean("enabled", True):
        return None
    values: dict[str, Any] = {}
    for f in kind.__dataclass_fields__:
        if f == "prompt":
            prompt = sub.string("prompt")
            if prompt is not None:
                _check_placeholders(f"stages.{name}.prompt", prompt, kind)
                values[f] = prompt
        else:
            values[f] = sub.integer(f, getattr(kind(), f), minimum=1)
    return kind(**values)


def _embed_on(st: _Table) -> bool:
    value = st.raw.get("embed", True)
    if isinstance(value, bool):
        return value
    sub = st.table("embed")
    sub.only("enabled")
    return sub.boolean("enabled", True)


_PLACEHOLDERS = {
    ContextStage: ("{document}", "{chunk}"),
    QuestionsStage: ("{document}", "{chunk}"),
    SummaryStage: ("{document}",),
}


_FIELDS = {ContextStage: {"document", "chunk"}, QuestionsStage: {"document", "chunk", "n"}}


def _check_placeholders(where: str, prompt: str, kind: type) -> None:
    """The prompt is filled by str.format: a field it does not know, or a lone brace, would
    fail every request after the models loaded; say it now."""
    known = _FIELDS.get(kind, {"document"})
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(prompt) if f is not None}
    except ValueError as e:
        raise SpecError(f"{where}: {e}: write a literal brace as {{{{ or }}}}") from e
    unknown = sorted(fields - known)
    if unknown:
        raise SpecError(
            f"{where}: unknown placeholder {{{unknown[0]}}}; the prompt may use "
            f"{', '.join('{' + k + '}' for k in sorted(known))} (a literal brace is {{{{ or }}}})"
        )
    missing = [p for p in _PLACEHOLDERS[kind] if p not in prompt]
    if missing:
        raise SpecError(f"{where}: the prompt lacks {', '.join(missing)}")
    if not prompt.startswith("{document}") and "{document}" in prompt:
        before = prompt.split("{document}", 1)[0]
        if "{chunk}" in before:
            raise SpecError(
                f"{where}: put {{document}} before {{chunk}}: the document is the prefix that "
                "all of its chunks share, computed once"
            )


def _outside_source(source: str, outputs: dict[str, str]) -> None:
    """The index and its run folders never inside the source (nor the source inside them): a
    run would read its own table, Parquet and manifests back as documents."""
    if source.startswith("s3://"):
        return
    src = Path(source)
    for name, value in outputs.items():
        if value.startswith("s3://"):
            continue
        out = Path(value)
        if out == src or out.is_relative_to(src) or src.is_relative_to(out):
            raise SpecError(
                f"{name}: {value} overlaps source.path {source}: put the index outside the "
                "documents' folder"
            )


def _s3_bucket(where: str, value: str) -> None:
    if value.startswith("s3://") and not value[len("s3://") :].split("/", 1)[0]:
        raise SpecError(f"{where}: {value!r} names no bucket (s3://bucket/prefix)")


def _local_or_s3(value: str, base: Path) -> str:
    return value if value.startswith("s3://") else _local(value, base)


def _local(value: str, base: Path) -> str:
    return str((base / Path(value).expanduser()).resolve())


def _model(value: str, base: Path) -> str:
    """A model given as a path (one that exists next to the spec, or reads as a path: ../x,
    ./x, /x, ~/x) is made absolute against the spec's folder; a Hub id is kept as written."""
    candidate = base / Path(value).expanduser()
    if candidate.exists():
        return str(candidate.resolve())
    try:
        split_hub_id(value)
    except ModelNotFoundError:  # not a Hub id: a path that does not exist (yet)
        return str(candidate.resolve())
    return value


class _Table:
    """One TOML table with typed getters whose errors name the dotted field."""

    def __init__(self, raw: Any, name: str, given: bool = True) -> None:
        if not isinstance(raw, dict):
            raise SpecError(f"{name}: expected a table ([{name}]), got {type(raw).__name__}")
        self.raw = raw
        self.name = name
        self.given = given

    def _field(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def only(self, *keys: str) -> None:
        unknown = sorted(set(self.raw) - set(keys))
        if unknown:
            raise SpecError(
                f"{self._field(unknown[0])}: unknown field; expected one of {', '.join(keys)}"
            )

    def table(self, key: str, required: bool = False) -> _Table:
        if key not in self.raw:
            if required:
                raise SpecError(f"{self._field(key)}: missing (add a [{self._field(key)}] table)")
            return _Table({}, self._field(key), given=False)
        return _Table(self.raw[key], self._field(key))

    def string(self, key: str, default: Any = None, required: bool = False) -> Any:
        if key not in self.raw:
            if required:
                raise SpecError(f"{self._field(key)}: missing")
            return default
        value = self.raw[key]
        if not isinstance(value, str) or not value:
            raise SpecError(f"{self._field(key)}: expected a non-empty string, got {value!r}")
        return value

    def strings(self, key: str, default: Any, nonempty: bool = False) -> list[str]:
        value = self.raw.get(key, default)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
            raise SpecError(f"{self._field(key)}: expected a list of strings, got {value!r}")
        if nonempty and not value:
            raise SpecError(f"{self._field(key)}: an empty list matches nothing; leave it out")
        return list(value)

    def integer(self, key: str, default: int, minimum: int) -> int:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"{self._field(key)}: expected an integer >= {minimum}, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self._field(key)}: expected true or false, got {value!r}")
        return value

"""The index spec: one TOML file says what to read, how to cut it, what to generate and where
the rows go (docs/INDEXING.md shows every field). The spec is a tree of pydantic models, as the
schedule file of `kvbatch beat` is: loading checks every field's type and range, and an error
names the field (`stages.questions.n: input should be greater than or equal to 1, got 0`), so a
nightly run fails at once on a typo instead of after the models loaded. What can be checked
only against the world (the source is there, the models load, the table takes the embedding's
dimension) is checked by kvbatch.index.preflight, still before any document is read."""

from __future__ import annotations

import hashlib
import json
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

import tomllib
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from kvbatch.field_errors import field_errors
from kvbatch.hub import ModelNotFoundError, split_hub_id
from kvbatch.index.prompts import CONTEXT_PROMPT, QUESTIONS_PROMPT, SUMMARY_PROMPT

DEFAULT_INCLUDE = ("*.md", "*.markdown", "*.txt", "*.html", "*.htm", "*.pdf")
DEFAULT_MAX_BYTES = 50 * 1024 * 1024

NonEmpty = Annotated[StrictStr, Field(min_length=1)]
Positive = Annotated[StrictInt, Field(ge=1)]


class SpecError(ValueError):
    """The spec file is missing, not TOML, or a field is wrong; the message names the field."""


class _Section(BaseModel):
    """A table of the spec: unknown keys are errors (a typo never passes silently); values
    keep their TOML types (no "3" read as 3)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True)


def _base(info: ValidationInfo) -> Path | None:
    """The spec file's folder, against which relative paths are read (None from Python)."""
    return (info.context or {}).get("base")


class SourceSpec(_Section):
    # a local folder (resolved against the spec's folder) or s3://bucket/prefix
    uri: NonEmpty = Field(alias="path")
    # the name of this source in the table: its rows are the ones a run may replace or delete
    name: NonEmpty | None = None
    include: tuple[NonEmpty, ...] = DEFAULT_INCLUDE  # fnmatch patterns over keys ('*' crosses '/')
    exclude: tuple[NonEmpty, ...] = ()
    max_bytes: Positive = DEFAULT_MAX_BYTES  # a larger document is an error record, never read

    @field_validator("uri")
    @classmethod
    def _resolved(cls, v: str, info: ValidationInfo) -> str:
        _s3_bucket(v)
        base = _base(info)
        return v if base is None else _local_or_s3(v, base)

    @field_validator("include", "exclude", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any, info: ValidationInfo) -> Any:
        v = [v] if isinstance(v, str) else v
        if info.field_name == "include" and isinstance(v, list) and not v:
            raise ValueError("an empty list matches nothing; leave it out")
        return v

    @field_validator("name")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and not v.isprintable():
            raise ValueError(f"{v!r}: use printable characters (it is shown in reports)")
        return v

    @property
    def owner(self) -> str:
        """The source's name in the table: `name`, else the folder's (or prefix's) last part
        and a digest of the URI and the globs, so two specs over different documents never
        take each other's rows. Moving the documents changes it: set `name` to keep it."""
        if self.name:
            return self.name
        key = json.dumps([self.uri, list(self.include), list(self.exclude)])
        tail = self.uri.rstrip("/").rsplit("/", 1)[-1] or "source"
        return f"{tail}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


class ChunkingSpec(_Section):
    size: Annotated[StrictInt, Field(ge=8)] = 256  # tokens of the embedding model's tokenizer
    overlap: Annotated[StrictInt, Field(ge=0)] = 0  # tokens shared by consecutive chunks

    @field_validator("overlap")
    @classmethod
    def _less_than_size(cls, v: int, info: ValidationInfo) -> int:
        size = info.data.get("size")
        if size is not None and v >= size:
            raise ValueError(f"{v} must be less than chunking.size ({size})")
        return v


class ModelsSpec(_Section):
    embedding: NonEmpty  # a folder or Hub id; its tokenizer also measures chunks
    generation: NonEmpty | None = None  # needed when context, questions or summary runs
    embedding_revision: NonEmpty | None = None
    generation_revision: NonEmpty | None = None

    @field_validator("embedding", "generation")
    @classmethod
    def _located(cls, v: str | None, info: ValidationInfo) -> str | None:
        base = _base(info)
        return v if v is None or base is None else _model(v, base)


class _Stage(_Section):
    enabled: StrictBool = Field(True, exclude=True)  # `enabled = false` turns a stage off

    @field_validator("prompt", check_fields=False)
    @classmethod
    def _fillable(cls, v: str) -> str:
        _check_placeholders(v, cls)
        return v


class ContextStage(_Stage):
    max_tokens: Positive = 100
    prompt: NonEmpty = CONTEXT_PROMPT  # {document} and {chunk}


class QuestionsStage(_Stage):
    n: Positive = 3
    max_tokens: Positive = 128
    prompt: NonEmpty = QUESTIONS_PROMPT  # {document}, {chunk} and {n}


class SummaryStage(_Stage):
    max_tokens: Positive = 128
    prompt: NonEmpty = SUMMARY_PROMPT  # {document}


class _Toggle(_Section):
    enabled: StrictBool = True


class StagesSpec(_Section):
    """A stage runs when its table is present (`[stages.context]`) unless `enabled = false`;
    `context = true/false` is the short form. Without any [stages] table, context and embed
    run (IndexSpec's default)."""

    context: ContextStage | None = None
    questions: QuestionsStage | None = None
    summary: SummaryStage | None = None
    embed: bool = True

    @field_validator("context", "questions", "summary", mode="before")
    @classmethod
    def _short_form(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return {} if v else None
        return v

    @field_validator("context", "questions", "summary")
    @classmethod
    def _on(cls, v: _Stage | None) -> _Stage | None:
        return v if v is not None and v.enabled else None

    @field_validator("embed", mode="before")
    @classmethod
    def _embed_table(cls, v: Any) -> Any:
        return _Toggle.model_validate(v).enabled if isinstance(v, dict) else v

    @property
    def generates(self) -> bool:
        return any(s is not None for s in (self.context, self.questions, self.summary))


class OutputSpec(_Section):
    uri: NonEmpty  # LanceDB: a local folder or s3://bucket/prefix
    # the run folders (stage jobs, Parquet rows, manifest): a local folder or s3://bucket/prefix
    # (a fleet shares nothing but the broker and the bucket); <uri>.runs when the spec does not
    # say (parse_spec fills it in), so on S3 beside an S3 table
    runs: NonEmpty | None = None
    table: NonEmpty = "chunks"

    @field_validator("uri")
    @classmethod
    def _resolved(cls, v: str, info: ValidationInfo) -> str:
        _s3_bucket(v)
        base = _base(info)
        return v if base is None else _local_or_s3(v, base)

    @field_validator("runs")
    @classmethod
    def _resolved_runs(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        _s3_bucket(v)
        base = _base(info)
        return v if base is None else _local_or_s3(v, base)

    @field_validator("table")
    @classmethod
    def _table_name(cls, v: str) -> str:
        if not v.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{v!r}: use letters, digits, '_' and '-' only")
        return v


class SearchSpec(_Section):
    """How `kvbatch search` reads the table (kvbatch.index.search)."""

    rerank: NonEmpty | None = None  # a cross-encoder (a folder or Hub id) to rerank the top hits
    mode: Literal["vector", "keyword", "hybrid"] | None = None  # None: hybrid when it can

    @field_validator("rerank")
    @classmethod
    def _located(cls, v: str | None, info: ValidationInfo) -> str | None:
        base = _base(info)
        return v if v is None or base is None else _model(v, base)


def _default_stages() -> StagesSpec:
    return StagesSpec(context=ContextStage())


class IndexSpec(_Section):
    source: SourceSpec
    models: ModelsSpec
    output: OutputSpec
    chunking: ChunkingSpec = Field(default_factory=ChunkingSpec)
    stages: StagesSpec = Field(default_factory=_default_stages)
    search: SearchSpec = Field(default_factory=SearchSpec)
    engine: dict[str, Any] = Field(default_factory=dict)  # kvbatch.engine.LLM keywords
    prompt_version: NonEmpty | None = None  # default: a digest of the prompts and stage settings

    @property
    def effective_prompt_version(self) -> str:
        """What a row's prompt_version says: the spec's name for it, or a digest of every
        prompt and stage setting that changes generated text, so an edit marks rows stale."""
        if self.prompt_version:
            return self.prompt_version
        stages = self.stages.model_dump()
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
    try:
        spec = IndexSpec.model_validate(raw, context={"base": base})
    except ValidationError as e:
        raise SpecError("; ".join(f"{f.field}: {f.message}" for f in field_errors(e))) from None
    _check_relations(spec)
    if spec.output.runs is None:
        runs = spec.output.uri.rstrip("/") + ".runs"
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"runs": runs})})
    return spec


def _check_relations(spec: IndexSpec) -> None:
    """What no single field can say: a field needed because of another, paths that overlap."""
    if spec.stages.generates and spec.models.generation is None:
        raise SpecError(
            "models.generation: required when stages context, questions or summary run "
            "(a folder or Hub id of a chat model)"
        )
    out = spec.output
    runs = out.runs or out.uri.rstrip("/") + ".runs"
    _outside_source(spec.source.uri, {"output.uri": out.uri, "output.runs": runs})
    for name, value in (("output.uri", out.uri), ("output.runs", runs)):
        if not value.startswith("s3://") and Path(value).exists() and not Path(value).is_dir():
            raise SpecError(f"{name}: {value} is a file; name a folder (it is created if absent)")


_PLACEHOLDERS = {
    "ContextStage": ("{document}", "{chunk}"),
    "QuestionsStage": ("{document}", "{chunk}"),
    "SummaryStage": ("{document}",),
}
_FIELDS = {"ContextStage": {"document", "chunk"}, "QuestionsStage": {"document", "chunk", "n"}}


def _check_placeholders(prompt: str, kind: type) -> None:
    """The prompt is filled by str.format: a field it does not know, or a lone brace, would
    fail every request after the models loaded; say it now (a ValueError: pydantic names the
    field)."""
    known = _FIELDS.get(kind.__name__, {"document"})
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(prompt) if f is not None}
    except ValueError as e:
        raise ValueError(f"{e}: write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(fields - known)
    if unknown:
        raise ValueError(
            f"unknown placeholder {{{unknown[0]}}}; the prompt may use "
            f"{', '.join('{' + k + '}' for k in sorted(known))} (a literal brace is {{{{ or }}}})"
        )
    missing = [p for p in _PLACEHOLDERS[kind.__name__] if p not in prompt]
    if missing:
        raise ValueError(f"the prompt lacks {', '.join(missing)}")
    if not prompt.startswith("{document}") and "{document}" in prompt:
        before = prompt.split("{document}", 1)[0]
        if "{chunk}" in before:
            raise ValueError(
                "put {document} before {chunk}: the document is the prefix that all of its "
                "chunks share, computed once"
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


_SCHEME_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def _s3_bucket(value: str) -> None:
    """A location is a local path or s3://bucket/prefix: any other scheme, or a mistyped one
    (`s3:/x`, `s3:x`), is refused here rather than becoming a local folder named `s3:`."""
    if value.startswith("s3://"):
        if not value[len("s3://") :].split("/", 1)[0]:
            raise ValueError(f"{value!r} names no bucket (s3://bucket/prefix)")
        return
    if _SCHEME_LIKE.match(value):
        raise ValueError(
            f"{value!r}: a local path or s3://bucket/prefix (no other scheme; "
            "write ./name for a local name with a colon)"
        )


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

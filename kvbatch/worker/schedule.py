"""The schedule file of `kvbatch beat`: recurring jobs, in TOML (or YAML).

    timezone = "UTC"                      # optional; cron times are read in this zone

    [[jobs]]
    name = "nightly-rag"                  # the run key is <name>-<YYYY-MM-DD>
    cron = "0 2 * * *"                    # minute hour day-of-month month day-of-week
    output = "s3://kvbatch/scheduled"     # job folders, inputs/ and runs/ go under it
    model = "/models/SmolLM2-135M-Instruct"
    # model_name = "SmolLM2-135M-Instruct"   shard_tokens = 200000   queue = "kvbatch"
    input = "s3://kvbatch/nightly.jsonl"  # a JSONL of requests

    [[jobs]]
    name = "docs-index"                   # an index run (docs/INDEXING.md): documents to a table
    cron = "0 2 * * *"
    index = "/specs/index.toml"           # its spec: output and models come from it
    # generation_queue = "..."  embedding_queue = "..."  shard_tokens = 200000

Every error is a ScheduleError that names the file, the entry and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from kvbatch.field_errors import field_errors
from kvbatch.jobs.storage import validate_key_part

CRON_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
REMOVED_DOCUMENTS = (
    "`documents` entries were removed: index a folder or s3:// prefix with an index spec "
    'instead, `index = "index.toml"` in this entry (and no output/model/input), which '
    "chunks, adds contexts, embeds and merges into a table (docs/INDEXING.md)"
)


class ScheduleError(ValueError):
    """The schedule file is missing, unreadable or invalid."""


def parse_cron(expr: str):
    """celery.schedules.crontab from a 5-field cron string ('0 2 * * *'); ValueError if bad."""
    from celery.schedules import crontab

    if not isinstance(expr, str):
        raise ValueError(f"expected a string, got {expr!r}")
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(
            f"{expr!r} has {len(fields)} fields; expected 5: minute hour day-of-month month "
            "day-of-week"
        )
    try:
        return crontab(**dict(zip(CRON_FIELDS, fields)))
    except Exception as e:  # celery raises ValueError or its own ParseException
        raise ValueError(f"{expr!r}: {e}") from None


class _Timed(BaseModel):
    """What every entry has: a name that keys its runs and a cron."""

    model_config = ConfigDict(extra="forbid")

    name: str
    cron: str
    shard_tokens: int = Field(default=200_000, gt=0)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        validate_key_part(v)  # it becomes part of a job id and of object keys
        if len(v) > 200:
            raise ValueError("at most 200 characters")
        return v

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, v: str) -> str:
        parse_cron(v)
        return v

    def crontab(self):
        return parse_cron(self.cron)


class ScheduleEntry(_Timed):
    """A recurring job: a JSONL of requests (`input`) sent to one model's queue."""

    output: str = Field(min_length=1)
    model: str = Field(min_length=1)
    input: str = Field(min_length=1)
    model_name: str | None = None
    max_attempts: int = Field(default=3, gt=0)
    queue: str = "kvbatch"

    @model_validator(mode="before")
    @classmethod
    def _no_documents(cls, data: Any) -> Any:
        if isinstance(data, dict) and "documents" in data:
            raise ValueError(REMOVED_DOCUMENTS)
        return data


class IndexEntry(_Timed):
    """A recurring index run (docs/INDEXING.md): `index` is the path of its spec, whose
    output and models it uses; its stages run on the workers of each model's queue
    (worker/index_trigger.py)."""

    index: str = Field(min_length=1)  # relative to the schedule file's folder
    generation_queue: str | None = None  # default kvbatch-<model folder name>
    embedding_queue: str | None = None


def _entry_kind(data: Any) -> str:
    return "index" if isinstance(data, dict) and "index" in data else "requests"


Entry = Annotated[
    Annotated[ScheduleEntry, Tag("requests")] | Annotated[IndexEntry, Tag("index")],
    Discriminator(_entry_kind),
]
_TAGS = ("requests", "index")


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timezone: str = "UTC"
    jobs: list[Entry] = Field(min_length=1)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {v!r}") from None
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> Schedule:
        seen: set[str] = set()
        for e in self.jobs:
            if e.name in seen:
                raise ValueError(f"two jobs are named {e.name!r}: names key the runs")
            seen.add(e.name)
        return self

    def entry(self, name: str) -> ScheduleEntry | IndexEntry:
        for e in self.jobs:
            if e.name == name:
                return e
        raise KeyError(f"no scheduled job named {name!r}")


def parse_schedule(data: Any, source: str = "schedule") -> Schedule:
    """Validate already-parsed data; errors name the entry (by name when it has one) and field."""
    try:
        return Schedule.model_validate(data)
    except ValidationError as e:
        raise ScheduleError(_describe(e, data, source)) from None


def load_schedule(path: str | Path) -> Schedule:
    """Read and validate a .toml (or .yaml/.yml) schedule file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ScheduleError(f"{path}: cannot read the schedule: {e.strerror or e}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ScheduleError(f"{path}: not valid YAML: {e}") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ScheduleError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise ScheduleError(f"{path}: expected a table with [[jobs]] entries")
    schedule = parse_schedule(data, str(path))
    for entry in schedule.jobs:  # an index spec's path is read from the schedule's folder,
        if isinstance(entry, IndexEntry):  # as the spec's own paths are from the spec's
            entry.index = str((path.parent / entry.index).resolve())
    return schedule


def _describe(err: ValidationError, data: Any, source: str) -> str:
    lines = []
    for error in field_errors(err):
        loc = list(error.location)
        where = "schedule"
        if len(loc) >= 2 and loc[0] == "jobs" and isinstance(loc[1], int):
            index = loc[1]
            name = None
            try:
                name = data["jobs"][index].get("name")
            except (KeyError, IndexError, TypeError, AttributeError):
                pass
            where = f"job {name!r}" if isinstance(name, str) else f"job #{index + 1}"
            loc = loc[2:]
            if loc and loc[0] in _TAGS:  # the kind of entry, not a field
                loc = loc[1:]
        field = ".".join(str(p) for p in loc)
        lines.append(f"{where}: {field or '(entry)'}: {error.message}")
    return f"{source}: " + "; ".join(lines)

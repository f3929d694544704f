"""What a run reports: counts, the prefill accounting, time per stage and the error records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ErrorRecord:
    """One document that could not be indexed this run; the rest of the run went on. Its rows
    from an earlier run, if any, are kept (nothing is lost), and it is tried again next run."""

    document_id: str
    stage: str  # read, parse, chunk, context, questions, summary, embed
    code: str  # too_large, binary, empty, unreadable, unparsable, too_long, generation_failed, ...
    message: str


@dataclass(frozen=True)
class PrefillTokens:
    """Prompt tokens of the generation stages. `computed` is what the engine prefilled (its
    usage: prompt tokens less cached tokens); `ideal` is each distinct prefix once (each
    document once + each chunk + instruction, in full cache blocks, as the engine shares
    them); `no_sharing` is every prompt token of every request."""

    computed: int = 0
    ideal: int = 0
    no_sharing: int = 0


@dataclass
class IndexReport:
    run_id: str = ""
    source: str = ""  # the source's name in the table: the rows this run may replace or delete
    embedding_revision: str = ""  # the revision (or "local-" fingerprint digest) rows carry
    generation_revision: str = ""  # "" without a generation stage
    documents_seen: int = 0  # every document the source listed
    documents_parsed: int = 0  # new, changed or stale ones read and chunked this run
    documents_skipped: int = 0  # unchanged since the rows in the table
    documents_deleted: int = 0  # gone from the source: their rows removed
    documents_failed: int = 0  # an error record each
    documents_windowed: int = 0  # too long for the generation model: given as windows
    chunks: int = 0  # chunks written (inserted or replaced) this run
    chunks_deleted: int = 0
    prefill: PrefillTokens = field(default_factory=PrefillTokens)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # plan, generate, embed, write
    errors: list[ErrorRecord] = field(default_factory=list)
    table_version: int | None = None  # the LanceDB table's version after the merge
    wrote: bool = False  # False when nothing changed: the table was not touched
    rebuilt: bool = False  # --rebuild: the table was written anew

    def to_dict(self) -> dict:
        return asdict(self)

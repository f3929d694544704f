"""What a run has to do, from the source listing and the table: each listed document is read
and hashed; one whose rows are current (same hash, same models, prompts and chunking) is
skipped; the others are parsed and chunked. Documents with rows but no longer listed are
deleted. A document that fails (too large, binary, empty, unparsable) is an error record and
keeps its old rows."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

from kvbatch.index.chunking import Chunk, Chunker
from kvbatch.index.identity import RowIdentity
from kvbatch.index.ids import content_hash
from kvbatch.index.parse import parse_document
from kvbatch.index.report import ErrorRecord
from kvbatch.index.sources import DocumentError, SourceDocument, list_documents, read_document
from kvbatch.index.spec import SourceSpec

log = logging.getLogger("kvbatch.index")


@dataclass(frozen=True)
class WorkDocument:
    id: str
    uri: str
    hash: str  # sha256 of its bytes
    text: str  # parsed
    chunks: list[Chunk]


@dataclass
class Plan:
    work: list[WorkDocument] = field(default_factory=list)
    seen: int = 0
    skipped: int = 0
    deleted: list[str] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.work and not self.deleted

    def run_id(self, identity: RowIdentity) -> str:
        """The same for the same work: a killed run, started again before its merge, finds
        the same plan, so the same run folder and its stage jobs' partial outputs."""
        key = {
            "identity": identity.key(),
            "work": [(d.id, d.hash) for d in self.work],
            "deleted": self.deleted,
        }
        return "run-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def make_plan(
    source: SourceSpec,
    state: dict[str, set[tuple[str, ...]]],
    identity: RowIdentity,
    chunker: Chunker,
    listed: list[SourceDocument] | None = None,
) -> Plan:
    """`state` is document_state of this source's rows: documents of other sources sharing
    the table are neither skipped nor deleted by this plan. `listed`: the source's listing,
    when the caller has it already."""
    plan = Plan()
    listed = list_documents(source) if listed is None else listed
    plan.seen = len(listed)
    current = identity.key()
    for doc in listed:
        try:
            data = read_document(doc, source.max_bytes)
            digest = content_hash(data)
            if state.get(doc.id) == {(digest, *current)}:
                plan.skipped += 1
                continue
            plan.work.append(_prepare(doc, data, digest, chunker, source.owner))
        except DocumentError as e:
            plan.errors.append(e.record(doc.id))
            log.warning("skipping %s: %s", doc.id, e)
    listed_ids = {d.id for d in listed}
    plan.deleted = sorted(set(state) - listed_ids)
    return plan


def _prepare(
    doc: SourceDocument, data: bytes, digest: str, chunker: Chunker, owner: str
) -> WorkDocument:
    text = parse_document(doc.id, data)
    chunks = chunker.chunk(doc.id, text, owner)
    if not chunks:
        raise DocumentError("chunk", "empty", "no chunk of text in it")
    return WorkDocument(doc.id, doc.uri, digest, text, chunks)

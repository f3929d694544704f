"""The generation stages (context, questions, summary) as one chat job: every prompt of a
document starts with the whole document, so a document's lines share it as a prefix, and the
job's prefix grouping runs them together: the document is prefilled once for all of them. A
document too long for the generation model's context is given as windows around its chunks
(kvbatch.index.windows): then each window is the prefix its chunks share.

custom_ids: `context:<chunk id>`, `questions:<chunk id>`, `summary:<hash of the document id>`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvbatch.index.ids import content_hash
from kvbatch.index.plan import WorkDocument
from kvbatch.index.report import ErrorRecord
from kvbatch.index.spec import StagesSpec
from kvbatch.index.stage_jobs import StageAnswers, chat_line, chat_text
from kvbatch.index.windows import DocumentWindows


@dataclass
class Generated:
    """Per chunk id its context and questions; per document id its summary."""

    context: dict[str, str] = field(default_factory=dict)
    questions: dict[str, list[str]] = field(default_factory=dict)
    summary: dict[str, str] = field(default_factory=dict)
    errors: list[ErrorRecord] = field(default_factory=list)


def generation_lines(
    docs: list[WorkDocument],
    stages: StagesSpec,
    model: str,
    windows: dict[str, DocumentWindows] | None = None,
) -> Iterator[dict]:
    """The job's lines; `windows` (by document id) gives what a prompt holds of a long
    document, a document without windows is given whole."""
    windows = windows or {}
    for doc in docs:
        doc_windows = windows.get(doc.id) or DocumentWindows(doc.text, doc.chunks, [], {})
        for chunk in doc.chunks:
            document = doc_windows.for_chunk(chunk)
            if stages.context is not None:
                prompt = stages.context.prompt.format(document=document, chunk=chunk.text)
                yield chat_line(
                    f"context:{chunk.chunk_id}", model, prompt, stages.context.max_tokens
                )
            if stages.questions is not None:
                q = stages.questions
                prompt = q.prompt.format(document=document, chunk=chunk.text, n=q.n)
                yield chat_line(f"questions:{chunk.chunk_id}", model, prompt, q.max_tokens)
        if stages.summary is not None:
            prompt = stages.summary.prompt.format(document=doc_windows.for_summary())
            yield chat_line(summary_id(doc), model, prompt, stages.summary.max_tokens)


def read_generated(
    docs: list[WorkDocument], stages: StagesSpec, answers: StageAnswers
) -> Generated:
    """The answers by chunk and document; a document with any failed line gets one error
    record (its first failure) and is left out of this run's rows."""
    out = Generated()
    for doc in docs:
        wanted = [cid for cid, _ in _custom_ids(doc, stages)]
        failed = next((cid for cid in wanted if cid not in answers.bodies), None)
        if failed is not None:
            err = answers.errors.get(failed, {"code": "missing", "message": "no answer"})
            stage = failed.split(":", 1)[0]
            out.errors.append(
                ErrorRecord(
                    doc.id,
                    stage,
                    err.get("code") or "generation_failed",
                    f"{doc.id}: {stage}: {err.get('message')}",
                )  # fmt: skip
            )
            continue
        for cid, kind in _custom_ids(doc, stages):
            text = chat_text(answers.bodies[cid])
            key = cid.split(":", 1)[1]
            if kind == "context":
                out.context[key] = text
            elif kind == "questions":
                out.questions[key] = _question_lines(text, stages.questions.n)
            else:
                out.summary[doc.id] = text
    return out


def summary_id(doc: WorkDocument) -> str:
    return f"summary:{content_hash(doc.id)[:32]}"


def _custom_ids(doc: WorkDocument, stages: StagesSpec) -> Iterator[tuple[str, str]]:
    for chunk in doc.chunks:
        if stages.context is not None:
            yield f"context:{chunk.chunk_id}", "context"
        if stages.questions is not None:
            yield f"questions:{chunk.chunk_id}", "questions"
    if stages.summary is not None:
        yield summary_id(doc), "summary"


def _question_lines(text: str, n: int) -> list[str]:
    """The answer's non-empty lines, list markers stripped, at most n."""
    lines = [ln.strip().lstrip("-*0123456789.) ").strip() for ln in text.splitlines()]
    return [ln for ln in lines if ln][:n]

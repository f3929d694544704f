"""What a row was made with. A row is current when its document's hash and every one of these
match the spec now; a change of the embedding model, the generation model, a prompt, a stage
setting or the chunking marks the document's rows stale, and the run redoes them."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path

from kvbatch.index.spec import IndexSpec
from kvbatch.jobs.model_fingerprint import fingerprint


@dataclass(frozen=True)
class RowIdentity:
    embedding_model: str
    embedding_revision: str
    generation_model: str  # "" when no generation stage runs
    generation_revision: str
    prompt_version: str
    chunking: str  # "size=256,overlap=32"

    def key(self) -> tuple[str, ...]:
        return astuple(self)


def row_identity(spec: IndexSpec) -> RowIdentity:
    generates = spec.stages.generates
    generation = spec.models.generation if generates else None
    return RowIdentity(
        embedding_model=spec.models.embedding,
        embedding_revision=model_revision(spec.models.embedding, spec.models.embedding_revision),
        generation_model=generation or "",
        generation_revision=(
            model_revision(generation, spec.models.generation_revision) if generation else ""
        ),
        prompt_version=spec.effective_prompt_version,
        chunking=f"size={spec.chunking.size},overlap={spec.chunking.overlap}",
    )


def model_revision(model: str, given: str | None) -> str:
    """The revision the spec names; else, for a local folder or .gguf file, "local-" and the
    digest of its fingerprint (kvbatch.jobs.model_fingerprint: its config, tokenizer and the
    content of its weights, sampled), so new weights of the same shapes are a new revision;
    else "main" (a Hub id's default branch). FingerprintError when a local checkpoint cannot
    be read (its config.json is not JSON)."""
    if given:
        return given
    path = Path(model).expanduser()
    if path.exists():
        return "local-" + fingerprint(path).digest
    return "main"

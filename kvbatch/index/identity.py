"""What a row was made with. A row is current when its document's hash and every one of these
match the spec now; a change of the embedding model, the generation model, a prompt, a stage
setting or the chunking marks the document's rows stale, and the run redoes them."""

from __future__ import annotations

import hashlib
from dataclasses import astuple, dataclass
from pathlib import Path

from kvbatch.index.spec import IndexSpec


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
    """The revision the spec names; else, for a local folder or file, a digest of its
    config.json and its weight files' names and sizes (new weights, new revision); else
    "main" (a Hub id's default branch)."""
    if given:
        return given
    path = Path(model)
    if path.is_file():
        return "local-" + _digest([f"{path.name}:{path.stat().st_size}".encode()])
    if path.is_dir():
        parts = []
        config = path / "config.json"
        if config.is_file():
            parts.append(config.read_bytes())
        for f in sorted(path.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
                parts.append(f"{f.name}:{f.stat().st_size}".encode())
        return "local-" + _digest(parts)
    return "main"


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]

"""A cheap fingerprint of a checkpoint, so that a worker can tell whether it holds the model a
job was submitted for (a worker started on another checkpoint must not answer its shards).

    config        config.json, generation_config.json and sentence-transformers' pooling
                  files, parsed and re-dumped with sorted keys (formatting does not count),
                  quantization_config included
    tokenizer     the bytes of every tokenizer and chat-template file
    weights       per weight file (safetensors shards, their index, a .gguf file): its name in
                  the folder, its size, and the sha256 of SAMPLES slices of SAMPLE_BYTES spread
                  over it (the first holds a safetensors or GGUF header: tensor names, shapes,
                  GGUF metadata and vocabulary); a lone .gguf file's name does not count
    quantization  the checkpoint's quantization method, readable ("none" for float weights)
    revision      the commit of a Hugging Face Hub snapshot (…/snapshots/<commit>/)

Never a hash of whole weight files: a fingerprint reads about SAMPLES x SAMPLE_BYTES per file,
however many gigabytes it holds (a file up to that size is hashed whole). A weight file's digest
is kept in memory by (path, size, mtime): a process that fingerprints an unchanged checkpoint
again (a scheduler's nightly index run, a worker's every job) reads nothing. Sampled slices of independently trained or fine-tuned
weights differ; two checkpoints that differ only outside every slice look the same (a
fine-tune of a single small tensor could): the price of being cheap.

The parts are compared one by one, and only the parts both sides have: `kvbatch submit` of
a Hub id reads the repository's config and tokenizer without its weights, so its job has no
`weights` part; a worker started on a local copy of a Hub repository has no `revision`.
Folder names and paths never count: the submitting machine and the workers may keep the
same checkpoint in different places. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

SAMPLES = 8
SAMPLE_BYTES = 64 * 1024
# the model's config, its generation defaults, and sentence-transformers' pooling files
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
WEIGHT_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json")
_COMMIT = re.compile(r"[0-9a-f]{40}")
PARTS = ("config", "tokenizer", "weights", "quantization", "revision")


class FingerprintError(ValueError):
    """A checkpoint cannot be fingerprinted (its config.json is not JSON, ...): names the file."""


@dataclass(frozen=True)
class ModelFingerprint:
    """Digests of a checkpoint's parts (PARTS); a part the checkpoint lacks is absent."""

    parts: dict[str, str]

    @property
    def digest(self) -> str:
        """One short id of the whole fingerprint, for logs."""
        text = json.dumps(self.parts, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        return {"digest": self.digest, **self.parts}

    @classmethod
    def from_dict(cls, d: dict) -> ModelFingerprint:
        """Read the fingerprint a job.json holds; a malformed one raises FingerprintError."""
        if not isinstance(d, dict):
            raise FingerprintError(f"a model fingerprint must be an object, got {d!r}")
        parts = {k: v for k, v in d.items() if k in PARTS}
        if not all(isinstance(v, str) for v in parts.values()):
            raise FingerprintError(f"a model fingerprint's parts must be strings: {d!r}")
        return cls(parts)

    def shared(self, other: ModelFingerprint) -> list[str]:
        """The parts both fingerprints have: the ones that can be compared."""
        return [p for p in PARTS if p in self.parts and p in other.parts]

    def differences(self, other: ModelFingerprint) -> list[str]:
        """The parts both fingerprints have and that differ ([] when they match)."""
        return [p for p in self.shared(other) if self.parts[p] != other.parts[p]]


def fingerprint(model: str | Path) -> ModelFingerprint:
    """The fingerprint of a local checkpoint: a Hugging Face folder or a .gguf file (a Hub id
    must be resolved to its snapshot folder first, kvbatch.hub.resolve_model)."""
    path = Path(model).expanduser()
    if path.is_file():  # a .gguf file: its name does not count (a renamed copy is the same)
        parts = {"weights": _weights_digest([("", path)])}
        revision = _hub_commit(path.parent)
        return ModelFingerprint(parts if revision is None else {**parts, "revision": revision})
    if not path.is_dir():
        raise FingerprintError(f"{path} is neither a checkpoint folder nor a .gguf file")
    parts: dict[str, str] = {}
    config = _config_digest(path)
    if config is not None:
        parts["config"], parts["quantization"] = config
    tokenizer = _files_digest(path, [n for n in TOKENIZER_FILES if (path / n).is_file()])
    if tokenizer is not None:
        parts["tokenizer"] = tokenizer
    weights = sorted(
        (p.name, p)
        for p in path.iterdir()
        if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or WEIGHT_INDEX.fullmatch(p.name))
    )
    if weights:
        parts["weights"] = _weights_digest(weights)
    revision = _hub_commit(path)
    if revision is not None:
        parts["revision"] = revision
    return ModelFingerprint(parts)


def describe_mismatch(job: ModelFingerprint, worker: ModelFingerprint) -> str | None:
    """Why a worker holding `worker` must not run a job submitted with `job`, or None."""
    if not job.shared(worker):
        return (
            f"this worker's model (fingerprint {worker.digest}, parts {', '.join(worker.parts)}) "
            f"has nothing to compare with the job's (fingerprint {job.digest}, parts "
            f"{', '.join(job.parts)}): a .gguf file and a folder are different checkpoints"
        )
    differ = job.differences(worker)
    if not differ:
        return None
    named = ", ".join(
        f"{p} ({job.parts[p]} here, {worker.parts[p]} on this worker)"
        if p in ("quantization", "revision")
        else p
        for p in differ
    )
    return (
        f"this worker's model (fingerprint {worker.digest}) is not the job's (fingerprint "
        f"{job.digest}): its {named} differ"
    )


def _config_digest(folder: Path) -> tuple[str, str] | None:
    """(digest of the configs, quantization method), or None without a config.json."""
    if not (folder / "config.json").is_file():
        return None
    h = hashlib.sha256()
    quantization = "none"
    for name in CONFIG_FILES:
        target = folder / name
        if not target.is_file():
            continue
        try:
            data = json.loads(target.read_bytes())
        except (OSError, ValueError) as e:
            raise FingerprintError(f"{target}: cannot read it as JSON ({e})") from None
        h.update(name.encode() + b"\0" + json.dumps(data, sort_keys=True).encode() + b"\0")
        if name == "config.json" and isinstance(data, dict):
            quantization = _quantization(data)
    return h.hexdigest(), quantization


def _quantization(config: dict) -> str:
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return "none"
    method = str(q.get("quant_method") or "unknown")
    return f"{method}:{q['format']}" if isinstance(q.get("format"), str) else method


def _files_digest(folder: Path, names: list[str]) -> str | None:
    if not names:
        return None
    h = hashlib.sha256()
    for name in sorted(names):
        data = (folder / name).read_bytes()
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _weights_digest(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    for name, path in files:
        size = path.stat().st_size
        h.update(f"{name}\0{size}\0".encode() + _sampled(path, size))
    return h.hexdigest()


_SAMPLED: dict[tuple[str, int, int], bytes] = {}


def _sampled(path: Path, size: int) -> bytes:
    """sha256 of SAMPLES slices spread evenly from the file's start to its end, remembered by
    (path, size, mtime): rewriting a file (a fine-tune saved over it) changes its mtime."""
    key = (str(path.resolve()), size, path.stat().st_mtime_ns)
    digest = _SAMPLED.get(key)
    if digest is None:
        digest = _SAMPLED[key] = _read_sampled(path, size)
    return digest


def _read_sampled(path: Path, size: int) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
            return h.digest()
        step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
        for i in range(SAMPLES):
            f.seek(i * step)
            h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def _hub_commit(folder: Path) -> str | None:
    """The commit of a huggingface_hub cache snapshot (<cache>/models--o--n/snapshots/<sha>)."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and _COMMIT.fullmatch(resolved.name):
        return resolved.name
    return None

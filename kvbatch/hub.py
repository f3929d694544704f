"""`--model` and `LLM(model=...)` as a local path or a Hugging Face Hub id, as vLLM takes them.

    path/to/folder  or  file.gguf           used as it is (a path that exists always wins)
    owner/name                              the repository's config, tokenizer and safetensors
    owner/name/path/in/repo/file.gguf       that one GGUF file of the repository

A Hub id is downloaded into huggingface_hub's own cache (HF_HOME / HF_HUB_CACHE) and the local
snapshot's path is returned, so the loader only ever sees files on disk. Only the files the
engine reads are fetched (ALLOW_PATTERNS), never a repository's .bin/.pth/.onnx copies of the
same weights. huggingface_hub itself honours HF_TOKEN (gated and private repositories),
HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE (the cache only); `revision` picks a branch, tag or
commit. The workers of one machine share the cache: a file lock around the download makes
the first one fetch and the others wait, then find it cached.

This module imports nothing of kvbatch, so the engine (`LLM`) and the command line both use
it without a cycle, and `kvbatch submit` resolves a tokenizer's Hub id without loading torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock
from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

# What the loader reads from a Hugging Face folder: configs, tokenizer files, chat templates,
# safetensors shards and their index.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
]


# `kvbatch submit` reads only the tokenizer (and the config for the context length).
TOKENIZER_PATTERNS = [p for p in ALLOW_PATTERNS if p != "*.safetensors"]


class ModelNotFoundError(ValueError):
    """`--model` is neither a local path nor a Hub repository that can be fetched; the
    message says which and what to do."""


def resolve_model(
    model: str | os.PathLike, revision: str | None = None, *, tokenizer_only: bool = False
) -> str:
    """The local path of `model`: itself when it exists, else a Hub id's download (or cached
    copy); raises ModelNotFoundError saying what to fix. `tokenizer_only`: a repository's
    configs and tokenizer without its weights (a GGUF file is fetched whole: it holds both)."""
    text = str(model)
    local = Path(text).expanduser()
    if local.exists():
        if revision is not None:
            raise ModelNotFoundError(
                f"--revision {revision} applies to Hub ids only, but {text} is a local path: "
                "drop --revision"
            )
        return str(local)
    repo_id, filename = split_hub_id(text)
    with FileLock(_lock_path(repo_id)):
        return _download(repo_id, filename, revision, tokenizer_only)


def is_hub_id(model: str | os.PathLike) -> bool:
    """True when `model` names no existing path but reads as a Hub id (owner/name[/f.gguf])."""
    if Path(str(model)).expanduser().exists():
        return False
    try:
        split_hub_id(str(model))
    except ModelNotFoundError:
        return False
    return True


def split_hub_id(text: str) -> tuple[str, str | None]:
    """'owner/name' -> (repo, None); 'owner/name/dir/file.gguf' -> (repo, 'dir/file.gguf').
    Raises ModelNotFoundError for what can be neither a missing path nor a repository id."""
    looks_like_path = text.startswith(("/", "./", "../", "~", "\\")) or (
        text.endswith(".gguf") and text.count("/") < 2
    )
    parts = text.split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or None
    if filename is not None and not filename.endswith(".gguf"):
        looks_like_path = True  # owner/name/x is a Hub id only for one GGUF file
    if not looks_like_path:
        try:
            validate_repo_id(repo_id)
        except HFValidationError:
            looks_like_path = True
    if looks_like_path:
        raise ModelNotFoundError(
            f"model {text!r} does not exist: give a Hugging Face folder (config.json, "
            "safetensors, tokenizer), a .gguf file, or a Hub id such as "
            "HuggingFaceTB/SmolLM2-135M-Instruct (owner/name[/file.gguf])"
        )
    return repo_id, filename


def _download(
    repo_id: str, filename: str | None, revision: str | None, tokenizer_only: bool = False
) -> str:
    name = repo_id + (f"/{filename}" if filename else "")
    where = f"no local path {name!r}; as a Hub id, {repo_id}" + (
        f" (revision {revision})" if revision else ""
    )
    try:
        if filename is not None:
            return hf_hub_download(repo_id, filename, revision=revision)
        patterns = TOKENIZER_PATTERNS if tokenizer_only else ALLOW_PATTERNS
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"{where} is gated: accept its terms on the Hub, then set HF_TOKEN to a token "
            f"of that account ({_first_line(e)})"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(
            f"{where}: no such revision on the Hub; give a branch, tag or commit it has"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"{where}: the Hub has no such repository that this token may read (check the "
            f"spelling; a private one needs HF_TOKEN) ({_first_line(e)})"
        ) from e
    except LocalEntryNotFoundError as e:
        offline = constants.HF_HUB_OFFLINE
        reason = (
            "HF_HUB_OFFLINE is set and it is not in the cache"
            if offline
            else "the Hub cannot be reached and it is not in the cache"
        )
        raise ModelNotFoundError(
            f"{where}: {reason} ({constants.HF_HUB_CACHE}); fetch it once online (without "
            "HF_HUB_OFFLINE), or give a local path"
        ) from e
    if not tokenizer_only and not any(Path(folder).glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{repo_id} has no safetensors weights at its top level; for a GGUF checkpoint "
            f"name the file: {repo_id}/FILE.gguf"
        )
    return folder


def _lock_path(repo_id: str) -> str:
    """One lock file per repository in the Hub cache, shared by the machine's workers."""
    folder = Path(constants.HF_HUB_CACHE) / ".locks" / "kvbatch"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / (repo_id.replace("/", "--") + ".lock"))


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__

"""Where a run's files go: the answers, the error records, batch.json and the resumable
partial output, checked before any work (a folder named as a file, the input named as an
output, two outputs in one file), and what a run that stops early says of its answers."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvbatch.jobs.local.options import JobError, RunOptions
from kvbatch.jobs.storage import StorageError


@dataclass
class JobPaths:
    output: str
    errors: str
    batch: str
    partial: Path
    # False for a run to stdout that found the usual partial output held by another run and
    # keeps its answers in one of its own (kvbatch.jobs.local.partial_claim), which --resume
    # does not look for
    resumable: bool = True


def resolve_paths(opts: RunOptions) -> JobPaths:
    if opts.output is None:
        if opts.input == "-" or opts.input.startswith("s3://"):
            raise JobError("give -o OUTPUT when the input is stdin or S3")
        opts_output = str(_beside(local_path(opts.input), ".output.jsonl"))
    else:
        opts_output = _file_name(opts.output, "-o")
    if opts_output == "-":
        errors = _file_name(opts.errors, "--errors") if opts.errors else "-stderr"
        batch = "-stderr"
    else:
        errors = (
            _file_name(opts.errors, "--errors")
            if opts.errors
            else _sibling(opts_output, ".errors.jsonl")
        )
        batch = _sibling(opts_output, ".batch.json")
    digest = hashlib.sha256(f"{opts.input}\0{opts_output}".encode()).hexdigest()[:16]
    if opts.work_dir:
        partial = Path(opts.work_dir) / f"{digest}.partial.jsonl"
    elif opts_output.startswith("s3://") or opts_output == "-":
        cache = Path(os.environ.get("KVBATCH_CACHE", Path.home() / ".cache" / "kvbatch"))
        partial = cache / "runs" / f"{digest}.partial.jsonl"
    else:
        out = Path(opts_output)
        partial = out.parent / f".{out.name}.partial"
    return JobPaths(opts_output, errors, batch, partial)


def local_path(uri: str) -> str:
    """A local path as the file system spells it (file:// dropped, ~ expanded): the lock and
    the partial output sit beside it, so they must be computed from the real path."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return uri if uri == "-" or "://" in uri else os.path.expanduser(uri)


def _file_name(uri: str, flag: str) -> str:
    """`uri`, local paths made real, after checking that it can name a file at all: one that
    ends in '/' (or '.', '..') names a folder, and the run would only fail after the model
    loaded, or write beside it under a dotted name."""
    path = local_path(uri)
    last = path.rstrip("/").rpartition("/")[2]
    if path != "-" and (path.endswith("/") or last in ("", ".", "..")):
        raise JobError(
            f"{flag} {uri} names a folder, not a file: name a file in it "
            f"({path.rstrip('/') or '.'}/answers.jsonl, say)"
        )
    return path


def _beside(path: str, suffix: str) -> Path:
    p = Path(path)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + suffix)


def _sibling(uri: str, suffix: str) -> str:
    head, _, name = uri.rpartition("/")
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return f"{head}/{stem}{suffix}" if head else f"{stem}{suffix}"


def kept_message(paths: JobPaths) -> str:
    if not paths.resumable:
        return (
            f"the answers finished so far are kept in {paths.partial}, this run's own partial "
            "output (another run to stdout held the usual one): --resume does not read it"
        )
    return (
        f"the answers finished so far are kept in {paths.partial}: fix that, then run the "
        "same command with --resume"
    )


def interrupted_message(paths: JobPaths) -> str:
    if holds_answers(paths.partial):
        if not paths.resumable:
            return f"interrupted; {kept_message(paths)}"
        return (
            f"interrupted; the answers finished so far are kept in {paths.partial}: run the "
            "same command with --resume to continue"
        )
    return "interrupted before any answer was finished: nothing to resume; run it again"


def holds_answers(partial: Path) -> bool:
    """Whether a partial output holds an answer after its header line (a link or a special
    file planted at its name is never followed: it holds none)."""
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        f.readline()
        return bool(f.read(1))


def refuse_overwriting_the_input(input_uri: str, outputs: list[str]) -> None:
    if input_uri == "-":  # stdin is read and stdout written: never one stream
        return
    if input_uri.startswith("s3://"):
        same = [o for o in outputs if o == input_uri]
    else:
        src = Path(input_uri).expanduser()
        same = [
            o
            for o in outputs
            if not o.startswith(("-", "s3://")) and _same_file(src, Path(o).expanduser())
        ]
    if same:
        raise StorageError(
            f"{same[0]} is the input file: the run would replace it; choose another -o/--errors"
        )


def refuse_one_file_twice(paths: JobPaths) -> None:
    """The answers, the error records and batch.json are written one after the other: were two
    of them one file (`--errors` naming the output), the later would silently replace the
    earlier, and a job would report answers that are gone."""
    named = [("the answers (-o)", paths.output), ("the error records (--errors)", paths.errors)]
    named.append(("batch.json", paths.batch))
    files = [(what, uri) for what, uri in named if not uri.startswith("-")]
    for i, (first, a) in enumerate(files):
        for second, b in files[i + 1 :]:
            same = a == b if "://" in a or "://" in b else _same_file(Path(a), Path(b))
            if same:
                raise StorageError(
                    f"{b} would hold both {first} and {second}, and the second would replace "
                    "the first: give -o and --errors different files (batch.json goes beside "
                    "the output, named like it with .batch.json)"
                )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()

"""Which partial output a run to stdout keeps its answers in: one of its own, locked.

A run with `-o FILE` holds FILE's lock (kvbatch.jobs.local.output_lock), so the partial output
named after FILE is its alone. A run to stdout (`-o -`) has no file to lock, and its partial
output is named after the input and `-`: two such runs of one input would share it, each
finalizing (and deleting) the other's answers. So a run to stdout locks the partial output
itself: the first takes the usual one (where `--resume` looks for it), and a run that finds it
held takes a fresh one, named after the run, that no other run reads.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kvbatch.jobs.local.output_lock import OutputBusy, output_lock

PARTIAL_SUFFIX = ".partial.jsonl"


@contextmanager
def claim_partial(partial: Path, input_uri: str, *, resume: bool) -> Iterator[Path]:
    """Hold a partial output for the block and give its path: `partial` when no other run
    holds it, else (unless `resume`, which must continue that one) a fresh one beside it.
    Raises OutputBusy when `resume` finds the partial output held by a run still going."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        claimed = partial
        try:
            held.enter_context(output_lock(str(partial), input_uri))
        except OutputBusy:
            if resume:
                raise OutputBusy(
                    f"--resume: the partial output {partial} is in use by another run to "
                    "stdout, still going: wait for it to finish, or run without --resume"
                ) from None
            claimed = _run_own(partial)
            held.enter_context(output_lock(str(claimed), input_uri))
        yield claimed


def _run_own(partial: Path) -> Path:
    stem = partial.name.removesuffix(PARTIAL_SUFFIX)
    return partial.with_name(f"{stem}.run-{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}")

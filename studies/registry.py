"""The studies by name: what `python -m studies NAME` runs.

Adding a study is one module with a `main(argv) -> int` and one line in `STUDIES`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

from studies import gc_freeze, host_overhead, kv_groups_host, step_plan


class Study(NamedTuple):
    main: Callable[[list[str] | None], int]
    question: str  # one line: what the study measures


STUDIES: dict[str, Study] = {
    "gc-freeze": Study(gc_freeze.main, "the cycle collector's pauses, startup heap frozen or not"),
    "host-overhead": Study(host_overhead.main, "host time per decode step, phase by phase"),
    "step-plan": Study(step_plan.main, "the scheduler's steps of a workload, model stubbed"),
    "kv-groups-host": Study(
        kv_groups_host.main, "host time of a decode step's KV bookkeeping, window groups or not"
    ),
}


def run(argv: list[str]) -> int:
    """Run the study named by argv[0] with the rest of argv; list the studies without one."""
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: python -m studies NAME [options]   (NAME -h for its options)\n")
        for name, study in STUDIES.items():
            print(f"  {name:<15} {study.question}")
        return 0
    name, *rest = argv
    if name not in STUDIES:
        print(
            f"python -m studies: unknown study {name!r}; known: {', '.join(STUDIES)}",
            file=sys.stderr,
        )
        return 2
    return STUDIES[name].main(rest)

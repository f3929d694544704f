"""How many CPU threads torch's intra-op pool gets: `--threads` of `run`, `generate` and `worker`.

torch starts one intra-op thread per core it sees, and its OpenMP threads spin while they wait
for work. When anything else wants the same cores (another torch process, a second worker on
the machine, a test suite), those spinning threads and the other work steal each other's time
slices, and a CPU job runs many times slower than with fewer threads. The default therefore takes only this process's share: the cores it may run on (its affinity mask, which
containers and `taskset` narrow) divided by the kvbatch workers that share the machine, where
that is known (KVBATCH_LOCAL_WORKERS), and no more than the cores left idle by what already
runs there (the machine's 1-minute load average at start). OMP_NUM_THREADS, when the user set
it, is taken as it is.

This module imports no torch: the parser that reads `--threads` serves `kvbatch status` too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LOCAL_WORKERS_ENV = "KVBATCH_LOCAL_WORKERS"
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def local_workers(env: Mapping[str, str] = os.environ) -> int:
    """The kvbatch workers sharing this machine's cores, from KVBATCH_LOCAL_WORKERS (default 1)."""
    text = env.get(LOCAL_WORKERS_ENV, "").strip()
    if not text:
        return 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{LOCAL_WORKERS_ENV}={text!r}: give the number of kvbatch workers on this "
            "machine, a whole number >= 1"
        )
    return value


def machine_load() -> float:
    """Runnable tasks on the whole machine, averaged over the last minute (0 where unknown)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def share_of_cores(usable: int, workers: int, machine_cores: int, load: float) -> int:
    """This process's threads: its usable cores split among the machine's workers, capped by
    the cores that the load leaves idle; at least 1."""
    idle = machine_cores - int(round(load))
    return max(1, min(usable // workers, idle))


def default_threads(env: Mapping[str, str] = os.environ) -> int:
    """OMP_NUM_THREADS when set, else this process's share of the usable, idle cores."""
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) >= 1:
        return int(explicit)
    machine = max(os.cpu_count() or 1, usable_cores())
    return share_of_cores(usable_cores(), local_workers(env), machine, machine_load())


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to `threads` (None: default_threads()) before a model
    loads; returns the number set. The environment variables are set too, so that processes
    this one starts and libraries that read them (OpenMP, MKL) agree."""
    n = default_threads() if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    for name in _THREAD_ENV:
        os.environ[name] = str(n)
    import torch  # here, not at the top: `kvbatch status` builds this parser without torch

    torch.set_num_threads(n)
    return n

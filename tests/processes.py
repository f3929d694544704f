"""Stopping the worker processes a test started: SIGTERM to each (a Celery worker finishes its
task's bookkeeping and exits), then a kill for any still alive after 10 s."""

from __future__ import annotations

import signal
import subprocess


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

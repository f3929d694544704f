"""The process's one Prometheus registry and its /metrics server.

Workers, `kvbatch run --metrics-port` and the index (`kvbatch index --metrics-port`,
`kvbatch index-worker`) all put their metrics here, so one port serves them all. Neutral: no
layer of kvbatch below it, so every layer may use it.
"""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, start_http_server

REGISTRY = CollectorRegistry()


def start_metrics_server(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY):
    """Serve /metrics on `port` in a daemon thread (port 0: nothing). Returns prometheus_client's
    (server, thread), or None when off."""
    if not port:
        return None
    return start_http_server(port, addr=addr, registry=registry)


def metrics_port(text: str) -> int:
    """argparse type of --metrics-port: a TCP port, or 0 for none. Out of range, socket's
    bind raises OverflowError, which is no OSError: a traceback instead of a message."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a port from 1 to 65535, or 0 for none, got {text}"
        )
    return port

"""The engines a benchmark compares, by name: kvbatch itself and its peers.

Adding an engine is one `Peer` subclass (kvbatch.bench.peer) that implements `load` and
`generate`, listed in `PEERS` below. A peer that can time its tokens fills `self.timings` in
`generate` (time to first token and time per output token per request); the table shows '-'
where it does not. Only kvbatch runs `long-prefill` (a prompt arriving mid-run needs a
streaming engine).
"""

from __future__ import annotations

from pathlib import Path

from kvbatch.bench.hf_peers import HFContinuousBatchingPeer, HFStaticPeer
from kvbatch.bench.kvbatch_peers import KvbatchInTurnPeer, KvbatchPeer
from kvbatch.bench.peer import EngineOptions, Peer, PeerUnavailable, RunResult, Timings

__all__ = [
    "PEERS",
    "EngineOptions",
    "KvbatchPeer",
    "Peer",
    "PeerUnavailable",
    "RunResult",
    "Timings",
    "make_peer",
]

PEERS: dict[str, type[Peer]] = {
    cls.name: cls
    for cls in (KvbatchPeer, KvbatchInTurnPeer, HFStaticPeer, HFContinuousBatchingPeer)
}
"""Registry by name, kvbatch first: the names `kvbatch bench --peers` accepts."""


def make_peer(name: str, model_path: str | Path, options: EngineOptions) -> Peer:
    """A new, unloaded engine of the registered kind `name`."""
    try:
        cls = PEERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(PEERS))}") from None
    return cls(model_path, options)

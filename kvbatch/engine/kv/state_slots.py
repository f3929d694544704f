"""The state cache of linear-attention layers: a pool of fixed-size state slots beside the
paged KV blocks.

A Gated DeltaNet layer keeps, per sequence, a conv state (the last kernel - 1 inputs of its
q, k, v channels) and a recurrent state ([key_dim, value_dim] per value head): the same size
at token 10 as at token 100,000. So a sequence holds one slot (every linear layer's two
states) for its whole life, however long, where a full-attention layer holds a block per
block_size tokens. A slot is also what a *snapshot* is: the states after a given prefix, kept
so that a later request sharing that prefix starts from a copy (engine/kv/stateful.py)::

    conv       [linear layers, slots, conv_dim, kernel - 1]        model dtype
    recurrent  [linear layers, slots, value heads, Dk, Dv]          float32

The recurrent state is kept in float32 whatever the model's dtype: it sums every token of the
prefix, and rounding it to bfloat16 each token would drift.

StateStep is what a forward reads: each scheduled chunk's slot, the snapshot a sequence
admitted on a prefix hit starts from, and where inside a prompt chunk to copy the states out
as snapshots. The copies happen inside each layer's forward, prompt chunks first and in step
order, so a sequence can start from a snapshot that an earlier chunk of the same step fills.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbatch.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class StateShape:
    num_layers: int  # linear-attention layers
    conv_dim: int
    conv_kernel: int
    num_heads: int  # value heads
    key_dim: int
    value_dim: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """One slot: every linear layer's conv state (model dtype) and recurrent state."""
        elem = torch.empty((), dtype=dtype).element_size()
        conv = self.conv_dim * (self.conv_kernel - 1) * elem
        recurrent = self.num_heads * self.key_dim * self.value_dim * 4
        return self.num_layers * (conv + recurrent)


class StatePool:
    """Slots of states on the device, and which are free."""

    def __init__(
        self, shape: StateShape, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.shape, self.num_slots = shape, num_slots
        s = shape
        self.conv = torch.zeros(
            s.num_layers, num_slots, s.conv_dim, s.conv_kernel - 1, dtype=dtype, device=device
        )
        self.recurrent = torch.zeros(
            s.num_layers, num_slots, s.num_heads, s.key_dim, s.value_dim,
            dtype=torch.float32, device=device,
        )  # fmt: skip
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A free slot, its states zeroed (the states before any token)."""
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def check_integrity(self, held: list[int]) -> None:
        """Every slot is free xor held once."""
        every = sorted(self._free + held)
        if every != list(range(self.num_slots)):
            raise RuntimeError(f"state slots: free {self._free} and held {held} do not partition")


@dataclass(frozen=True)
class SnapshotAt:
    offset: int  # tokens of the chunk after which the states are copied (1 .. query_len)
    slot: int  # the snapshot's slot


@dataclass(frozen=True)
class StateSpan:
    """One prompt chunk of the step (more than one token), in the flat token order."""

    query_start: int
    query_len: int
    slot: int
    snapshots: tuple[SnapshotAt, ...] = ()
    init_from: int = -1  # a snapshot's slot to copy the states from first (-1: none)


@dataclass
class StateStep:
    """The states a forward reads and writes: the first num_decodes tokens are one-token
    chunks (decodes, or prompts cut to one token), each in its slot; then the prompt chunks."""

    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64, on the device
    prefills: list[StateSpan]
    # (decode row, snapshot slot): states copied after a one-token chunk
    decode_snapshots: list[tuple[int, int]] = field(default_factory=list)
    # (decode row, snapshot slot): states copied before (a sequence admitted on a hit)
    decode_inits: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StatefulMeta:
    """The attention metadata of a step and its StateStep, as a hybrid model's forward reads
    them (the full-attention layers get `attention`, the linear ones `states`)."""

    attention: AttentionMetadata
    states: StateStep
    pool: StatePool

    @property
    def num_decode_tokens(self) -> int:
        return self.attention.num_decode_tokens


def fresh_states(
    attention: AttentionMetadata, shape: StateShape, dtype: torch.dtype, device: torch.device
) -> StatefulMeta:
    """A StatefulMeta in which every chunk of `attention` starts from zero states, in a pool
    of its own: a forward outside the engine's runner (the startup's profile of the largest
    step, a test's prefill), whose states are dropped afterwards."""
    d = attention.num_decode_tokens
    pool = StatePool(shape, max(1, d + len(attention.prefills)), dtype, device)
    spans = [
        StateSpan(span.query_start, span.query_len, d + i)
        for i, span in enumerate(attention.prefills)
    ]
    slots = torch.arange(d, dtype=torch.int64, device=device)
    return StatefulMeta(attention, StateStep(d, slots, spans), pool)

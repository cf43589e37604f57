"""Byte and message accounting per rank and per operation kind.

Point-to-point traffic is counted exactly (every isend is one message of ``nbytes`` on the
wire), which is what lets a test assert that a ring all-reduce sent 2(P-1)/P of the buffer and
not three times that. A native collective's wire traffic depends on the backend's internal
algorithm, which we do not observe, so for those we count calls and the payload handed to the
backend, and say so (``native_bytes``, never ``bytes_sent``). ``handed_bytes`` counts every
collective call's input, whichever algorithm runs it: the figure to compare with a system whose
wire traffic is not observed (torch DDP and its hooks).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict


@dataclasses.dataclass
class OpCounters:
    """Counters of one operation kind on one rank."""

    calls: int = 0
    """Operations issued."""
    messages_sent: int = 0
    """Point-to-point messages sent (exact)."""
    messages_recv: int = 0
    """Point-to-point messages received (exact)."""
    bytes_sent: int = 0
    """Bytes sent point-to-point (exact)."""
    bytes_recv: int = 0
    """Bytes received point-to-point (exact)."""
    native_bytes: int = 0
    """Bytes handed to the backend's native collectives (their wire traffic depends on the
    backend's algorithm)."""
    handed_bytes: int = 0
    """Bytes of the buffers handed to collectives, gloo's or commfuse's own algorithms alike
    (each rank's input, as ``native_bytes``): what a caller asked to communicate, independent
    of the algorithm that moved it. A ring all-reduce of n bytes counts n here and its exact
    2 (P - 1) / P n in ``bytes_sent``; torch DDP's hooks can only be counted this way."""

    def add(self, other: OpCounters) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class CommStats:
    """Per-kind counters. Kinds are free-form: ``send``, ``recv``, ``all_reduce``, ..., and the
    algorithms of layer 2 label their point-to-point traffic with their own name."""

    def __init__(self) -> None:
        self.by_kind: defaultdict[str, OpCounters] = defaultdict(OpCounters)

    def __getitem__(self, kind: str) -> OpCounters:
        return self.by_kind[kind]

    def total(self) -> OpCounters:
        out = OpCounters()
        for counters in self.by_kind.values():
            out.add(counters)
        return out

    def reset(self) -> None:
        self.by_kind.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain dict (picklable, JSON-able) of the counters, kinds sorted."""
        return {kind: dataclasses.asdict(self.by_kind[kind]) for kind in sorted(self.by_kind)}

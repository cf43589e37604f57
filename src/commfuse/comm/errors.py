"""Errors raised by the communicator. Each names the rank, the operation, the peer and the step.

nccl-tests names host, rank and operation on every failure; a user staring at a hung job needs
exactly that, so every message here is built by ``describe_op``.
"""

from __future__ import annotations

from typing import Any

# Phrases gloo and NCCL use in their errors; matched case-insensitively to classify a failure.
_TIMEOUT_PHRASES = ("timed out", "timeout")
_LOST_PEER_PHRASES = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "pair closure",
    "closed by peer",
    "socket closed",
    "unexpected end",
)


def says_timed_out(message: str) -> bool:
    """Whether a backend's error message says an operation ran out of time."""
    lowered = message.lower()
    return any(phrase in lowered for phrase in _TIMEOUT_PHRASES)


def says_peer_lost(message: str) -> bool:
    """Whether a backend's error message says a connection to a peer was lost."""
    lowered = message.lower()
    return any(phrase in lowered for phrase in _LOST_PEER_PHRASES)


def describe_op(
    *,
    rank: int,
    op: str,
    peer: int | None = None,
    step: int | None = None,
    nbytes: int | None = None,
    group: str = "world",
) -> str:
    parts = [f"rank {rank}", op]
    if peer is not None:
        parts.append(f"peer {peer}")
    if nbytes is not None:
        parts.append(f"{nbytes} bytes")
    if step is not None:
        parts.append(f"step {step}")
    if group != "world":
        parts.append(f"group {group}")
    return ", ".join(parts)


class CommError(RuntimeError):
    """A communication operation failed; the process group should be considered unusable."""

    def __init__(
        self, message: str, *, rank: int, op: str, peer: int | None = None, step: int | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.peer = peer
        self.step = step

    def __reduce__(self) -> tuple[object, ...]:
        # The fields are keyword-only, which pickle's default (args only) cannot rebuild; errors
        # travel from rank processes to their launcher by pickle.
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls: type[CommError], message: str, fields: dict[str, Any]) -> CommError:
    return cls(message, **fields)


class CommTimeoutError(CommError, TimeoutError):
    """A wait passed its deadline: a peer is slow, hung, or waiting on a different operation."""


class PeerFailureError(CommError):
    """The transport lost a peer mid-operation (its process most likely died).

    ``failed_rank`` is the (world) rank whose failure broke the job, when the job's failure
    notice names it (``commfuse.cluster.failures``): the dead rank itself, not the neighbour
    that gave up because of it. None when nobody could tell."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        op: str,
        peer: int | None = None,
        step: int | None = None,
        failed_rank: int | None = None,
    ) -> None:
        super().__init__(message, rank=rank, op=op, peer=peer, step=step)
        self.failed_rank = failed_rank


class InconsistentInputError(ValueError):
    """Ranks called the same collective with tensors that disagree (shape, dtype, size)."""

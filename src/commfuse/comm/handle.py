"""Handles of asynchronous operations: ``wait()`` always has a deadline.

A gloo or NCCL ``Work`` waited on without a timeout blocks until the backend's own timeout (30
minutes by default): a hung peer then looks like a slow job. Every wait here passes the
communicator's deadline, and a failure is re-raised as ``CommTimeoutError`` or
``PeerFailureError`` with the rank, operation, peer and step in the message.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from typing import Protocol

import torch.distributed as dist

from commfuse.comm.errors import CommError, CommTimeoutError, PeerFailureError, describe_op
from commfuse.comm.trace import TraceEvent, now_us

# Phrases gloo and NCCL use; matched case-insensitively to classify a backend failure.
_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_WORDS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "pair closure",
    "closed by peer",
    "socket closed",
    "unexpected end",
)


class Waitable(Protocol):
    def wait(self, deadline_s: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


class OpContext:
    """What a failure message needs to know about an operation."""

    __slots__ = ("group", "nbytes", "op", "peer", "rank", "step")

    def __init__(
        self, *, rank: int, op: str, peer: int | None, nbytes: int, step: int | None, group: str
    ) -> None:
        self.rank, self.op, self.peer, self.nbytes, self.step, self.group = (
            rank,
            op,
            peer,
            nbytes,
            step,
            group,
        )

    def describe(self) -> str:
        return describe_op(
            rank=self.rank,
            op=self.op,
            peer=self.peer,
            step=self.step,
            nbytes=self.nbytes,
            group=self.group,
        )


def translate_failure(err: BaseException, ctx: OpContext, deadline_s: float) -> CommError:
    """Turn a backend exception into a CommError that names rank, operation, peer and step."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    lowered = str(err).lower()
    cls: type[CommError] = CommError
    message = f"{ctx.describe()}: {text}"
    if any(word in lowered for word in _PEER_WORDS):
        who = f"peer {ctx.peer}" if ctx.peer is not None else "a peer"
        cls = PeerFailureError
        message = f"{ctx.describe()}: lost {who} mid-operation (did its process die?): {text}"
    elif any(word in lowered for word in _TIMEOUT_WORDS):
        cls = CommTimeoutError
        message = (
            f"{ctx.describe()}: not finished within the {deadline_s:g} s deadline "
            f"(a peer is hung, slow, or called a different operation): {text}"
        )
    return cls(message, rank=ctx.rank, op=ctx.op, peer=ctx.peer, step=ctx.step)


class Handle:
    """One asynchronous operation. ``wait()`` is idempotent and enforces the deadline."""

    def __init__(
        self,
        work: dist.Work | None,
        ctx: OpContext,
        *,
        deadline_s: float,
        event: TraceEvent | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._ctx = ctx
        self._deadline_s = deadline_s
        self._event = event
        self._then = then
        self._done = work is None
        if work is None:
            if event is not None:
                event.end_us = event.start_us
            if then is not None:
                then()
                self._then = None
        elif event is not None:
            # Some p2p works have no future; those are stamped at wait() instead.
            with contextlib.suppress(RuntimeError):
                work.get_future().add_done_callback(lambda _fut: _stamp(event))

    @property
    def context(self) -> OpContext:
        return self._ctx

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed())

    def wait(self, deadline_s: float | None = None) -> None:
        if self._done:
            return
        assert self._work is not None
        limit = self._deadline_s if deadline_s is None else deadline_s
        try:
            self._work.wait(datetime.timedelta(seconds=limit))
        except Exception as err:
            raise translate_failure(err, self._ctx, limit) from err
        self._done = True
        if self._event is not None and self._event.end_us is None:
            self._event.end_us = now_us()
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _stamp(event: TraceEvent) -> None:
    if event.end_us is None:
        event.end_us = now_us()


def wait_all(handles: Sequence[Waitable], deadline_s: float | None = None) -> None:
    for handle in handles:
        handle.wait(deadline_s)

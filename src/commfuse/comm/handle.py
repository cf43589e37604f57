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
from torch._C._distributed_c10d import Store

from commfuse.cluster.failures import FailureNotice, post_failure, read_failure
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


#: Seconds a rank that lost an unnamed peer (inside a native collective, the backend does not
#: say which) waits for the launcher's notice naming the rank that died.
NOTICE_WAIT_S = 2.0


class FailureBoard:
    """The job's failure notice (``commfuse.cluster.failures``) as one communicator sees it:
    the store every rank shares, and how to turn this group's ranks into the job's."""

    __slots__ = ("rank", "store", "world_rank_of")

    def __init__(self, store: Store, *, rank: int, world_rank_of: Callable[[int], int]) -> None:
        self.store = store
        self.rank = rank
        """This process's world rank."""
        self.world_rank_of = world_rank_of

    def explain(self, ctx: OpContext, *, lost_peer: bool) -> FailureNotice | None:
        """The failure that broke ``ctx``'s operation, if the job knows it. A lost peer that
        nobody has reported yet is reported here (first report wins): a rank that sees its
        neighbour vanish tells the ranks stuck behind it who is gone."""
        notice = read_failure(self.store)
        if notice is None and lost_peer:
            if ctx.peer is not None:
                lost = FailureNotice(
                    self.world_rank_of(ctx.peer), f"lost by rank {self.rank} during {ctx.op}"
                )
                try:
                    notice = post_failure(self.store, lost)
                except (RuntimeError, ValueError):  # no store to tell: say what we saw
                    notice = lost
            else:
                notice = read_failure(self.store, wait_s=NOTICE_WAIT_S)
        return notice if notice is not None and notice.rank != self.rank else None


class Waitable(Protocol):
    def wait(self, deadline_s: float | None = None) -> None: ...

    def is_completed(self) -> bool: ...


class OpContext:
    """What a failure message needs to know about an operation."""

    __slots__ = ("board", "group", "nbytes", "op", "peer", "rank", "step")

    def __init__(
        self,
        *,
        rank: int,
        op: str,
        peer: int | None,
        nbytes: int,
        step: int | None,
        group: str,
        board: FailureBoard | None = None,
    ) -> None:
        self.rank, self.op, self.peer, self.nbytes, self.step, self.group = (
            rank,
            op,
            peer,
            nbytes,
            step,
            group,
        )
        self.board = board

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
    lost_peer = any(word in lowered for word in _PEER_WORDS)
    timed_out = not lost_peer and any(word in lowered for word in _TIMEOUT_WORDS)
    notice = (
        ctx.board.explain(ctx, lost_peer=lost_peer)
        if ctx.board is not None and (lost_peer or timed_out)
        else None
    )
    if notice is not None:
        # Name the job's first failure, not the neighbour that gave up because of it.
        return PeerFailureError(
            f"{ctx.describe()}: rank {notice.rank} {notice.detail} (the job's first failure), "
            f"so this operation cannot complete: {text}",
            rank=ctx.rank,
            op=ctx.op,
            peer=ctx.peer,
            step=ctx.step,
            failed_rank=notice.rank,
        )
    if lost_peer:
        who = f"peer {ctx.peer}" if ctx.peer is not None else "a peer"
        cls = PeerFailureError
        message = f"{ctx.describe()}: lost {who} mid-operation (did its process die?): {text}"
    elif timed_out:
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

"""Handles of asynchronous operations: ``wait()`` always has a deadline.

A gloo or NCCL ``Work`` waited on without a timeout blocks until the backend's own timeout (30
minutes by default): a hung peer then looks like a slow job. Every wait here passes the
communicator's deadline, and a failure is re-raised as ``CommTimeoutError`` or
``PeerFailureError`` with the rank, operation, peer and step in the message.

A rank does not learn of a death from its sockets alone. The ranks next to the dead one see
their connections close, but a rank waiting on a live neighbour, or on a peer whose host lost its
link (no FIN or RST ever arrives), would wait out the whole deadline. So a watched wait (a gloo
collective, or a job of commfuse's own on the worker thread) waits in slices of
``WATCH_INTERVAL_S`` and between slices reads the job's failure notice
(``commfuse.cluster.failures``): once it names a member of this operation's group, the wait
raises ``PeerFailureError`` naming that rank. A point-to-point wait is not sliced (gloo treats a
timed-out send or receive as the failure of its whole context); the process's watch thread
(``watch.py``) reads the notice for it instead. A large message's wait (``on_thread``) blocks on
a thread of ``waiters.py`` while the caller waits for it in slices: gloo cannot wake a wait whose
message it was moving when the peer died, and the caller then raises without it.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from commfuse.cluster.failures import FailureNotice, post_failure, read_failure
from commfuse.comm.errors import (
    CommError,
    CommTimeoutError,
    PeerFailureError,
    describe_op,
    says_peer_lost,
    says_timed_out,
)
from commfuse.comm.exit_guard import hold_exit_for
from commfuse.comm.trace import TraceEvent, now_us
from commfuse.comm.waiters import WAITERS
from commfuse.comm.watch import PEER_WATCH, UNWOKEN_AFTER_S, WATCH_INTERVAL_S

#: Seconds a rank that lost an unnamed peer (inside a native collective, the backend does not
#: say which) waits for the launcher's notice naming the rank that died.
_NOTICE_WAIT_S = 2.0


class FailureBoard:
    """The job's failure notice (``commfuse.cluster.failures``) as one communicator sees it:
    the store every rank shares, and how to turn this group's ranks into the job's."""

    __slots__ = (
        "__weakref__",
        "members",
        "rank",
        "stop_group",
        "stopped",
        "store",
        "world_rank_of",
    )

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_rank_of: Callable[[int], int],
        members: frozenset[int],
        stop_group: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        """This process's world rank."""
        self.world_rank_of = world_rank_of
        self.members = members
        """The world ranks of the group: a failure elsewhere in the job does not stop its work."""
        self.stop_group = stop_group
        """Makes every wait still blocked in the group raise, given the world rank that died
        (None: the backend has no way, and each wait runs to its deadline)."""
        self.stopped = False

    def member_failure(self) -> FailureNotice | None:
        """The job's notice, if it names another member of this group (without waiting); the
        first time it does, the group is stopped, so no wait of it stays blocked on the dead."""
        notice = read_failure(self.store)
        if notice is None or notice.rank == self.rank or notice.rank not in self.members:
            return None
        if self.stop_group is not None and not self.stopped:
            self.stopped = True
            self.stop_group(notice.rank)
        return notice

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
                notice = read_failure(self.store, wait_s=_NOTICE_WAIT_S)
        return notice if notice is not None and notice.rank != self.rank else None


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


def _failed_because_of(notice: FailureNotice, ctx: OpContext, what: str) -> PeerFailureError:
    """The error of ``ctx``'s operation, which ``notice``'s failure made impossible; ``what``
    says what this rank saw."""
    return PeerFailureError(
        f"{ctx.describe()}: rank {notice.rank} {notice.detail} (the job's first failure), "
        f"so this operation cannot complete: {what}",
        rank=ctx.rank,
        op=ctx.op,
        peer=ctx.peer,
        step=ctx.step,
        failed_rank=notice.rank,
    )


def translate_failure(err: BaseException, ctx: OpContext, deadline_s: float) -> CommError:
    """Turn a backend exception into a CommError that names rank, operation, peer and step."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    cls: type[CommError] = CommError
    message = f"{ctx.describe()}: {text}"
    lost_peer = says_peer_lost(str(err))
    timed_out = not lost_peer and says_timed_out(str(err))
    notice = (
        ctx.board.explain(ctx, lost_peer=lost_peer)
        if ctx.board is not None and (lost_peer or timed_out)
        else None
    )
    if notice is not None:
        # Name the job's first failure, not the neighbour that gave up because of it.
        return _failed_because_of(notice, ctx, text)
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
    """One asynchronous operation; ``wait()`` is idempotent and enforces the deadline.

    The operation is one of three kinds, behind the same interface:

    * a backend ``Work`` (a point-to-point message, a native collective): its failure is
      translated into a ``CommError`` that names rank, operation, peer and step;
    * a ``Future`` of a job on the communicator's worker thread (one of commfuse's own
      collectives, queued with ``Communicator.submit``): its error is re-raised as it is,
      ``result()`` returns what the job returned;
    * nothing left to do (``Handle.completed()``: a world of one, an empty tensor, a result
      restored from a checkpoint).
    """

    def __init__(
        self,
        work: dist.Work | Future[Any] | None,
        ctx: OpContext,
        *,
        deadline_s: float,
        event: TraceEvent | None = None,
        then: Callable[[], None] | None = None,
        watched: bool = False,
        on_thread: bool = False,
    ) -> None:
        self._work = work
        self._ctx = ctx
        self._watched = watched and ctx.board is not None
        """Wait in slices, reading the job's failure notice between them (see the module
        docstring); only for waits that a timed-out slice leaves intact."""
        self._on_thread = on_thread
        """A point-to-point wait of a group that can be stopped, run on a waiting thread and
        waited for in slices (see the module docstring); ``result`` takes the other paths
        first."""
        self._deadline_s = deadline_s
        self._event = event
        self._then = then
        self._value: Any = None
        self._done = work is None
        if work is None:
            if event is not None:
                event.end_us = event.start_us
            if then is not None:
                then()
                self._then = None
        elif event is not None and not isinstance(work, Future):
            # Some p2p works have no future; those are stamped at wait() instead.
            with contextlib.suppress(RuntimeError):
                work.get_future().add_done_callback(lambda _fut: _stamp(event))

    @classmethod
    def completed(cls, result: Any = None, *, op: str = "completed") -> Handle:
        """The handle of an operation that is already done; ``result()`` returns ``result``."""
        ctx = OpContext(rank=-1, op=op, peer=None, nbytes=0, step=None, group="")
        handle = cls(None, ctx, deadline_s=0.0)
        handle._value = result
        return handle

    @property
    def context(self) -> OpContext:
        return self._ctx

    @property
    def description(self) -> str:
        """The operation's kind, e.g. ``all_reduce.ring``."""
        return self._ctx.op

    def is_completed(self) -> bool:
        if self._done or self._work is None:
            return True
        return self._work.done() if isinstance(self._work, Future) else self._work.is_completed()

    def wait(self, deadline_s: float | None = None) -> None:
        self.result(deadline_s)

    def result(self, deadline_s: float | None = None) -> Any:
        """Wait, then return what a worker job returned (or the result given to ``completed``;
        None for a backend ``Work``)."""
        work = self._work
        if work is None:
            return self._value
        limit = self._deadline_s if deadline_s is None else deadline_s
        if isinstance(work, Future):
            try:
                return self._in_slices(work.result, work.done, limit)
            except FutureTimeout:
                ctx = self._ctx
                # The job's collectives may still be pending: exit_guard.py.
                hold_exit_for(lambda: not work.done())
                raise CommTimeoutError(
                    f"rank {ctx.rank}, {ctx.op}: not finished within the {limit:g} s deadline "
                    "(a peer is hung, slow, or issued collectives in a different order)",
                    rank=ctx.rank,
                    op=ctx.op,
                    step=ctx.step,
                ) from None
        if self._done:
            return None
        try:
            board = self._ctx.board
            if self._watched or board is None or board.stop_group is None:
                self._in_slices(
                    lambda s: work.wait(datetime.timedelta(seconds=s)), work.is_completed, limit
                )
            elif self._on_thread:
                self._on_waiting_thread(work, board, limit)
            else:
                # A point-to-point wait cannot be sliced (gloo fails its context when a receive
                # times out), so the process's watch thread reads the notice for it.
                token = PEER_WATCH.add(board, self._ctx, limit)
                try:
                    work.wait(datetime.timedelta(seconds=limit))
                finally:
                    PEER_WATCH.remove(token)
        except CommError:
            hold_exit_for(lambda: not work.is_completed())  # exit_guard.py
            raise
        except Exception as err:
            hold_exit_for(lambda: not work.is_completed())
            raise translate_failure(err, self._ctx, limit) from err
        self._done = True
        if self._event is not None and self._event.end_us is None:
            self._event.end_us = now_us()
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return None

    def _on_waiting_thread(self, work: dist.Work, board: FailureBoard, limit: float) -> None:
        """``work.wait(limit)`` on a waiting thread, waited for in slices; between them the
        job's notice is read, and once it names a member of the group, the group is stopped.
        A wait the stop wakes raises its own error; one it cannot wake is left to its thread,
        and this raises ``PeerFailureError`` naming the dead rank."""
        result = WAITERS.submit(lambda: work.wait(datetime.timedelta(seconds=limit)))
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            try:
                result.result(timeout=max(0.0, min(WATCH_INTERVAL_S, left)))
                return
            except FutureTimeout:
                if left <= WATCH_INTERVAL_S:
                    result.result()  # the backend's own deadline ends it, with its error
                    return
            notice = board.member_failure()
            if notice is None:
                continue
            try:
                result.result(timeout=UNWOKEN_AFTER_S)
                return
            except FutureTimeout:
                waited = limit - (deadline - time.monotonic())
                raise _failed_because_of(
                    notice,
                    self._ctx,
                    f"still waiting after {waited:.1f} s, and the backend cannot wake this wait "
                    "(the peer died in the middle of the message)",
                ) from None

    def _in_slices(
        self, wait: Callable[[float], Any], done: Callable[[], bool], limit: float
    ) -> Any:
        """``wait(limit)``, or for a watched handle ``wait(slice)`` until it returns, the limit
        is spent, or the job's notice names a member of the group (``PeerFailureError``). A
        slice that runs out raises what ``wait`` raises on a timeout; an operation that is not
        ``done()`` after ``wait`` raised has only run out of slice (a failed one is done)."""
        board = self._ctx.board
        if not self._watched or board is None:
            return wait(limit)
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            try:
                return wait(max(0.0, min(WATCH_INTERVAL_S, left)))
            except Exception:
                if left <= WATCH_INTERVAL_S or done():
                    raise
            notice = board.member_failure()
            if notice is not None:
                waited = limit - (deadline - time.monotonic())
                raise _failed_because_of(notice, self._ctx, f"still waiting after {waited:.1f} s")


def _stamp(event: TraceEvent) -> None:
    if event.end_us is None:
        event.end_us = now_us()


def wait_all(handles: Sequence[Handle], deadline_s: float | None = None) -> None:
    """Wait for every handle in turn, each within ``deadline_s`` (the handle's own deadline
    when None); the first that fails raises its error (``CommTimeoutError``, ...)."""
    for handle in handles:
        handle.wait(deadline_s)

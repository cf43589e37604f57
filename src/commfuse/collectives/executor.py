"""The asynchronous form of commfuse collectives: one worker thread per communicator.

Our algorithms are sequences of dependent point-to-point steps written in Python, so their
async form runs the whole sequence on a background thread and hands back a handle. The thread
spends its time inside gloo's send/recv and torch's reductions, both of which release the GIL,
so the caller's computation really overlaps the collective (the fused operators and the
training engine rely on this). One thread per communicator runs collectives in the order they
were issued, which is what keeps ranks matched: every rank issues the same collectives in the
same order, and nothing reorders them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from commfuse.comm import CommTimeoutError, Communicator


class CollectiveHandle:
    """A collective running in the background. ``wait()`` re-raises its error, with a deadline."""

    def __init__(self, future: Future[Any], comm: Communicator, description: str) -> None:
        self._future = future
        self._comm = comm
        self.description = description

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self, deadline_s: float | None = None) -> None:
        self.result(deadline_s)

    def result(self, deadline_s: float | None = None) -> Any:
        """Wait, then return what the queued function returned (re-raising its error)."""
        limit = self._comm.config.deadline_s if deadline_s is None else deadline_s
        try:
            return self._future.result(timeout=limit)
        except FutureTimeout:
            raise CommTimeoutError(
                f"rank {self._comm.rank}, {self.description}: not finished within the {limit:g} s deadline "
                "(a peer is hung, slow, or issued collectives in a different order)",
                rank=self._comm.rank,
                op=self.description,
                step=self._comm.step,
            ) from None


class CompletedHandle:
    """The handle of a collective that had nothing to do (world of one, empty tensor)."""

    description = "completed"

    def is_completed(self) -> bool:
        return True

    def wait(self, deadline_s: float | None = None) -> None:
        return None

    def result(self, deadline_s: float | None = None) -> Any:
        return None


_EXECUTORS: weakref.WeakKeyDictionary[Communicator, ThreadPoolExecutor] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def _executor_for(comm: Communicator) -> ThreadPoolExecutor:
    with _LOCK:
        executor = _EXECUTORS.get(comm)
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"commfuse-{comm.name}")
            _EXECUTORS[comm] = executor
            weakref.finalize(comm, executor.shutdown, wait=False)
        return executor


_WORKER = threading.local()
"""Set on a communicator's worker thread, so collectives issued from inside a queued function
(a compressor's several rounds, a hook) run directly instead of waiting on themselves."""


def on_worker_thread() -> bool:
    """True inside a function queued with ``submit`` (on any communicator's worker)."""
    return bool(getattr(_WORKER, "active", False))


def _in_worker(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _WORKER.active = True
    try:
        return fn(*args, **kwargs)
    finally:
        _WORKER.active = False


_LAST: weakref.WeakKeyDictionary[Communicator, CollectiveHandle] = weakref.WeakKeyDictionary()


def submit(
    comm: Communicator, description: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> CollectiveHandle:
    """Queue ``fn(*args, **kwargs)`` behind the communicator's earlier collectives."""
    if on_worker_thread():
        # Already on a worker, in issue order: run now (queueing would wait on ourselves).
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:
            future.set_exception(err)
        return CollectiveHandle(future, comm, description)
    handle = CollectiveHandle(
        _executor_for(comm).submit(_in_worker, fn, *args, **kwargs), comm, description
    )
    _LAST[comm] = handle
    return handle


def drain(comm: Communicator) -> None:
    """Wait for the communicator's queued collectives, so a synchronous one issued now runs
    after them, in the same order on every rank."""
    if on_worker_thread():
        return
    last = _LAST.pop(comm, None)
    if last is not None:
        last.wait()

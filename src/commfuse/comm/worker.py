"""The asynchronous form of commfuse's own collectives: one worker thread per communicator.

Our algorithms are sequences of dependent point-to-point steps written in Python, so their
async form runs the whole sequence on a background thread and hands back a handle. The thread
spends its time inside gloo's send/recv and torch's reductions, both of which release the GIL,
so the caller's computation really overlaps the collective (the fused operators and the
training engine rely on this). One thread per communicator runs jobs in the order they were
issued, which is what keeps ranks matched: every rank issues the same collectives in the same
order, and nothing reorders them.

A ``Worker`` belongs to one ``Communicator`` (``Communicator.submit`` and ``drain`` use it);
its thread starts with the first job and stops when the communicator is collected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class _ThreadFlag(threading.local):
    """Per thread: whether it is running a worker's job (False on every new thread)."""

    active = False


_ON_WORKER = _ThreadFlag()
"""Set on a worker thread, so collectives issued from inside a queued job (a compressor's
several rounds, a hook) run directly instead of waiting on themselves."""


def on_worker_thread() -> bool:
    """True inside a job queued with ``Communicator.submit`` (on any communicator's worker)."""
    return _ON_WORKER.active


def _in_worker(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _ON_WORKER.active = True
    try:
        return fn(*args, **kwargs)
    finally:
        _ON_WORKER.active = False


class Worker:
    """A single thread that runs jobs in issue order (started by the first one)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Queue ``fn(*args, **kwargs)`` behind the earlier jobs. On a worker thread already
        (a job issuing collectives) it runs now: queueing would wait on itself."""
        if on_worker_thread():
            future: Future[Any] = Future()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:
                future.set_exception(err)
            return future
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"commfuse-{self._name}"
                )
            return self._executor.submit(_in_worker, fn, *args, **kwargs)

    def shutdown(self) -> None:
        """Stop the thread once its queued jobs are done (does not wait for them)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

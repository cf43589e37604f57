"""Threads that block in a backend's wait, so that the caller can wait in slices.

gloo cannot wake one kind of point-to-point wait: a receive (or send) whose message it was
moving when the peer died (``watch.py``). Blocked in it, a thread stays blocked until the wait's
own deadline, whatever stops the group. So a large message's wait runs here instead: the caller
waits for the result in slices of ``WATCH_INTERVAL_S`` and reads the job's failure notice between
them (``Handle``), and can raise at once while the backend's wait stays behind on its thread
until its deadline ends it.

The threads are daemons, started as needed: one that a dead peer holds is simply not reused
until its wait ends, and the next wait gets another. Handing a wait over costs a thread switch
each way (tens of microseconds), which is why only messages from ``CommConfig.wait_thread_min_bytes``
up take this path: at 1 MB a message takes milliseconds on the wire.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_MAX_THREADS = 64
"""At most this many threads: past it, a wait queues for the next free one (only waits that
dead peers hold keep threads busy for long)."""


class Waiters:
    """A pool of daemon threads that run blocking calls and hand back their results."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        self.submitted = 0
        """Calls run so far (how many waits took this path)."""

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Run ``call`` on a free thread; its result or exception comes back in the future."""
        future: Future[Any] = Future()
        with self._lock:
            self.submitted += 1
            if self._idle:
                self._idle -= 1  # a waiting thread takes it
            elif self._threads < _MAX_THREADS:
                self._threads += 1
                threading.Thread(
                    target=self._work, name=f"commfuse-wait-{self._threads}", daemon=True
                ).start()
            self._jobs.put((future, call))
        return future

    def _work(self) -> None:
        while True:
            future, call = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._idle += 1
                continue
            try:
                value, error = call(), None
            except BaseException as err:  # handed to the caller, as a thread pool does
                value, error = None, err
            # Idle before the caller hears: its next call then finds this thread.
            with self._lock:
                self._idle += 1
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)


WAITERS = Waiters()
"""The process's waiting threads."""

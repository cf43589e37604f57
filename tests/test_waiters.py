"""The waiting threads (``comm/waiters.py``): results and errors come back through the future,
a thread a call holds is not handed the next call, and idle threads are reused."""

from __future__ import annotations

import threading

import pytest

from commfuse.comm.waiters import Waiters


def test_results_and_errors_come_back() -> None:
    waiters = Waiters()
    assert waiters.submit(lambda: 42).result(timeout=5) == 42

    def fail() -> None:
        raise RuntimeError("gloo: connection closed")

    with pytest.raises(RuntimeError, match="connection closed"):
        waiters.submit(fail).result(timeout=5)
    assert waiters.submitted == 2


def test_a_held_thread_does_not_hold_the_next_call() -> None:
    """A call that never returns (a wait gloo cannot wake) keeps its thread; the next call runs
    on another one at once."""
    waiters = Waiters()
    release = threading.Event()
    held = waiters.submit(release.wait)
    assert waiters.submit(lambda: "next").result(timeout=5) == "next"
    assert not held.done()
    release.set()
    assert held.result(timeout=5) is True


def test_idle_threads_are_reused() -> None:
    waiters = Waiters()
    names = {waiters.submit(lambda: threading.current_thread().name).result(timeout=5)}
    for _ in range(20):
        names.add(waiters.submit(lambda: threading.current_thread().name).result(timeout=5))
    assert len(names) == 1

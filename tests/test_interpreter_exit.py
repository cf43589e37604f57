"""A script may leave the interpreter right after its last collective.

gloo's work-loop thread takes the GIL after a collective to release the tensors it held; if the
interpreter is finalising by then, the process dies of SIGABRT after the script had done
everything right (``commfuse.comm.interpreter_exit``). ``scripts/exit_after_collective.py``
makes that certain without the guard (both ranks die in every launch) and checks its sum.
"""

from __future__ import annotations

import _thread
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commfuse.comm.interpreter_exit import (
    STABLE_S,
    WAIT_LIMIT_S,
    let_native_threads_finish,
    native_threads_in_interpreter,
)

SCRIPT = Path(__file__).parent / "scripts" / "exit_after_collective.py"
LAUNCH = "import sys; from commfuse.cli import main; sys.exit(main())"


@pytest.mark.slow
def test_a_rank_that_exits_while_gloo_still_needs_the_interpreter_exits_cleanly() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, "launch", "--nproc", "2", "--timeout", "60", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert sorted(proc.stdout.splitlines()) == [
        "[rank 0] rank 0 of 2 sums",
        "[rank 1] rank 1 of 2 sums",
    ], proc.stdout


def start_unregistered_threads(lifetimes_s: list[float]) -> set[int]:
    """Threads that ``threading`` does not know, as a native thread inside the interpreter is;
    returns the ones there before (another test's may still be)."""
    before = native_threads_in_interpreter()
    for lifetime_s in lifetimes_s:
        _thread.start_new_thread(time.sleep, (lifetime_s,))
    deadline = time.monotonic() + 5.0
    while len(native_threads_in_interpreter() - before) < len(lifetimes_s):
        assert time.monotonic() < deadline, "the threads did not start"
        time.sleep(0.001)
    return before


def test_exit_waits_while_native_threads_leave_the_interpreter() -> None:
    # Each leaves 60 ms after the one before: less than STABLE_S apart, so exit waits for all.
    lifetimes_s = [0.06 * (k + 1) for k in range(5)]
    before = start_unregistered_threads(lifetimes_s)
    start = time.monotonic()
    let_native_threads_finish()
    assert native_threads_in_interpreter() <= before
    assert time.monotonic() - start < WAIT_LIMIT_S


def test_exit_does_not_wait_for_a_native_thread_that_stays() -> None:
    before = start_unregistered_threads([2 * WAIT_LIMIT_S])
    start = time.monotonic()
    let_native_threads_finish()
    waited_s = time.monotonic() - start
    assert len(native_threads_in_interpreter() - before) == 1
    assert STABLE_S <= waited_s < WAIT_LIMIT_S

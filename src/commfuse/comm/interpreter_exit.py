"""Leaving the interpreter while a backend thread still needs it.

gloo runs each collective on a thread of its own (``ProcessGroupGloo``'s work loop). When the
collective is done, that thread drops its reference to the work, and with it to the tensors
the work held. A tensor that Python also knows has a Python object, and torch's PyObject
preservation makes the last C++ reference but one give that object back, which needs the GIL.
So after every collective the work-loop thread waits, briefly, for the interpreter.

If the main thread leaves the interpreter first (the script's last line came right after its
last collective), Python, while finalising, ends every thread that then asks for the GIL. For a
native thread inside a C++ destructor, which may not be unwound, that ends the process:
``terminate called without an active exception``, SIGABRT, after the script had done
everything right (torch issue 190489; the same happens with ``destroy_process_group()``
called, since a live ``Communicator`` still holds the group).

The guard below runs at interpreter exit, before finalising begins: it releases the GIL, then
waits while the interpreter's thread states that belong to no Python thread keep changing. A
native thread inside ``gil_scoped_acquire`` has one (pybind11 makes it for the span of the call)
and drops it once it has had the GIL, so the set changes until every such thread is done; some
native threads keep one for good (torch's autograd threads for CUDA devices), and a set that
stays the same for ``STABLE_S`` holds only those.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

_SETTLE_S = 0.01
"""First release of the GIL at exit: long enough for a native thread that has just finished a
collective to reach the interpreter."""

STABLE_S = 0.1
"""How long the set of native threads' thread states must stay the same before exit goes on:
a native thread waiting for the GIL gets it within this while the main thread sleeps."""

WAIT_LIMIT_S = 2.0
"""The longest exit waits for native threads inside the interpreter."""

_installed = False
_lock = threading.Lock()


def native_threads_in_interpreter() -> set[int]:
    """Thread ids of the interpreter's thread states that no ``threading`` thread owns: native
    threads inside a call into the interpreter (holding the GIL or waiting for it), or keeping a
    thread state for good."""
    python_threads = {thread.ident for thread in threading.enumerate()}
    return set(sys._current_exceptions()) - python_threads


def let_native_threads_finish() -> None:
    """Release the GIL until no native thread is left waiting for the interpreter: none is
    inside it, or the same ones have stayed for ``STABLE_S`` (at most ``WAIT_LIMIT_S``)."""
    time.sleep(_SETTLE_S)
    deadline = time.monotonic() + WAIT_LIMIT_S
    inside, changed = native_threads_in_interpreter(), time.monotonic()
    while inside:
        now = time.monotonic()
        if now - changed >= STABLE_S or now >= deadline:
            return
        time.sleep(0.001)
        now_inside = native_threads_in_interpreter()
        if now_inside != inside:
            inside, changed = now_inside, time.monotonic()


def guard_interpreter_exit() -> None:
    """Run ``let_native_threads_finish`` when the interpreter exits (once per process)."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(let_native_threads_finish)
            _installed = True

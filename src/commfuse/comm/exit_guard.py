"""Leaving a process after a collective failed, instead of hanging in its teardown.

gloo keeps a collective whose wait timed out pending: its threads still wait for the peer's
half. Nothing the backend offers ends that wait (``abort``, ``shutdown`` and
``destroy_process_group`` all return or block, and the work stays), and at interpreter exit the
process group's destructor joins those threads. So a rank that raised ``CommTimeoutError``, or
caught it and finished its script, would then sit in its teardown until gloo's own timeout (30
minutes unless ``init_process_group`` set another), and a launcher would see a hung job rather
than a failed one.

So a wait that fails leaves its operation here (``hold_exit_for``), and at exit, if one of
them is still pending, the process ends with ``os._exit`` instead of the teardown that would
wait for it: after the interpreter has printed an uncaught exception's traceback and run the
``atexit`` functions registered after commfuse was imported (this check is registered at
import, and ``atexit`` runs the last registered first), with logging shut down and the standard
streams flushed. The status is the script's own where it called ``sys.exit(n)``, 1 when an
exception went uncaught, else 0. A process whose failed operations all ended by exit time
(gloo's timeout came, or the peer caught up) exits as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

_lock = threading.Lock()
_pending: list[Callable[[], bool]] = []
_status: dict[str, Any] = {}  # "exit": what sys.exit was given; "uncaught": True


def hold_exit_for(still_pending: Callable[[], bool]) -> None:
    """Remember an operation whose wait failed (``still_pending()`` says whether the backend
    still runs it); the first one installs the hooks that read the script's exit status."""
    with _lock:
        first = not _status.get("hooked")
        _status["hooked"] = True
        # Those that ended since are forgotten: a long run's failed steps do not pile up.
        _pending[:] = [p for p in _pending if _still(p)] + [still_pending]
    if first:
        _record_exit_status()


def _record_exit_status() -> None:
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def record_uncaught(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        _status["uncaught"] = True
        previous_hook(kind, value, tb)

    def record_exit(status: str | int | None = None) -> None:
        _status["exit"] = status
        previous_exit(status)

    sys.excepthook = record_uncaught
    sys.exit = record_exit  # type: ignore[assignment]


def _exit_status() -> int:
    if "exit" in _status:
        given = _status["exit"]
        if given is None:
            return 0
        return given if isinstance(given, int) else 1  # sys.exit("message") exits 1
    return 1 if _status.get("uncaught") else 0


def _leave_if_stuck() -> None:
    with _lock:
        stuck = any(_still(pending) for pending in _pending)
    if not stuck:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_status())


def _still(pending: Callable[[], bool]) -> bool:
    try:
        return pending()
    except Exception:  # a backend that cannot say: assume the teardown would wait
        return True


atexit.register(_leave_if_stuck)

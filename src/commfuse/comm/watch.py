"""Waking the point-to-point waits that a death leaves blocked.

A rank learns of a death from its sockets only when it talks to the dead rank and the dead
rank's connections close. A rank waiting on a live neighbour that is itself stuck, or on a host
that lost its link (no FIN or RST ever arrives), would wait out its whole deadline. A collective's
wait reads the job's failure notice between slices of its wait (``Handle``), but a
point-to-point wait cannot be sliced: gloo fails the whole context of a group when one of its
receives times out.

So one daemon thread per process watches for them: while any point-to-point wait is blocked
it reads, every ``WATCH_INTERVAL_S``, the failure notice of each group that has one waiting
(``FailureBoard.member_failure``). Once the notice names a member of the group, the group is
stopped, which turns every wait still blocked in it into an error that names the dead rank. A
wait that ends within the interval never costs a store read. The one wait a stop cannot end (a
receive gloo was reading into when its sender died: ``_PeerWatch``) is named on stderr instead,
and raises at its deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from commfuse.cluster.failures import read_failure
from commfuse.comm.errors import says_peer_lost, says_timed_out

if TYPE_CHECKING:
    from commfuse.comm.handle import FailureBoard, OpContext

WATCH_INTERVAL_S = 0.5
"""Seconds between two reads of the job's failure notice while a wait goes on: how late, at
most, a rank learns of a death its own sockets do not show (one store round trip each)."""

UNWOKEN_AFTER_S = 2 * WATCH_INTERVAL_S
"""Seconds a wait may stay blocked after its group was stopped before it is named as one the
stop could not end: a woken wait raises within milliseconds, a loaded machine's scheduler may
take a few hundred."""


class _PeerWatch:
    """The thread that reads the failure notice of the groups with a blocked wait.

    A wait registers with ``add`` and leaves with ``remove``: a plain lock and a dict entry, so
    a wait costs about a microsecond more (the thread polls at ``WATCH_INTERVAL_S`` rather than
    being woken, which would cost a thread switch per wait).

    One wait the stop cannot end: a receive whose message gloo had begun to read when the
    sender died (a message of a megabyte or more waits on a waiting thread instead, and its
    caller raises without it: ``waiters.py``). gloo tells a closed connection's posted
    receives and sends, but not the one it is reading into, and nothing else reaches it (not a
    failed context, not the backend's ``abort``); it ends only at its own deadline. So a wait
    still blocked ``UNWOKEN_AFTER_S`` after its group was stopped is named on stderr at once
    (``_unwakeable_wait``): which rank, operation and peer, the job's failure, and when the
    wait will raise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, _Wait] = {}
        self._thread: threading.Thread | None = None

    def add(self, board: FailureBoard, ctx: OpContext, deadline_s: float) -> int:
        """Count a wait of ``board``'s group as blocked (until ``remove`` with the returned
        token); ``ctx`` and ``deadline_s`` say what it is if it cannot be woken."""
        wait = _Wait(board, ctx, deadline_s)
        token = id(wait)
        with self._lock:
            self._waiting[token] = wait
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="commfuse-peer-watch", daemon=True
                )
                self._thread.start()
        return token

    def remove(self, token: int) -> None:
        with self._lock:
            del self._waiting[token]

    def _run(self) -> None:
        seen: set[int] = set()
        stopped_at: dict[FailureBoard, float] = {}
        while True:
            time.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            with self._lock:
                waits = dict(self._waiting)
            # A board read only once a wait of it has lasted a whole interval: a wait that ends
            # within one never costs a store read.
            boards = {w.board for token, w in waits.items() if token in seen}
            for board in boards:
                if not board.stopped:
                    # The watch outlives any one group: a store that went away (the launcher is
                    # gone, the job is ending) leaves that group's waits to their deadlines.
                    with contextlib.suppress(Exception):
                        board.member_failure()
                if board.stopped:
                    stopped_at.setdefault(board, now)
            for wait in waits.values():
                since = stopped_at.get(wait.board)
                # A wait begun after the stop fails at once by itself.
                if wait.told or since is None or since <= wait.start:
                    continue
                if now - since >= UNWOKEN_AFTER_S:
                    wait.told = True
                    with contextlib.suppress(Exception):
                        sys.stderr.write(_unwakeable_wait(wait, now) + "\n")
                        sys.stderr.flush()
            seen = set(waits)


class _Wait:
    """One blocked point-to-point wait, as the watch sees it."""

    __slots__ = ("board", "ctx", "deadline_s", "start", "told")

    def __init__(self, board: FailureBoard, ctx: OpContext, deadline_s: float) -> None:
        self.board, self.ctx, self.deadline_s = board, ctx, deadline_s
        self.start = time.monotonic()
        self.told = False


def _unwakeable_wait(wait: _Wait, now: float) -> str:
    """The line that names a wait its stopped group could not end."""
    notice = read_failure(wait.board.store)
    cause = (
        f"rank {notice.rank} {notice.detail} (the job's first failure)"
        if notice is not None
        else "a member of its group failed"
    )
    left = max(0.0, wait.start + wait.deadline_s - now)
    return (
        f"commfuse: {wait.ctx.describe()}: {cause}; this wait cannot be woken (gloo does not "
        "tell a receive whose message it had begun to read that the sender died), so it "
        f"raises at its deadline, in {left:.0f} s"
    )


_STOP_TAG = 0x7FFF_FFF0
"""The tag of the receive that stops a gloo group: one no sender ever uses."""


def gloo_stopper(group: dist.ProcessGroup, device: torch.device) -> Callable[[int], None]:
    """How to wake every wait still blocked in a gloo group once a member died: post a receive
    and let it time out at once. gloo fails a context whose receive timed out, and with it every
    send, receive and collective pending on that context, which then raise (and name the dead
    rank through the job's notice); the group is unusable afterwards, as it already was.

    The receive is from the dead rank first. Where gloo has already seen that rank's connection
    close, the receive fails at once without failing the context (and a wait posted on that
    connection just before may never have been told), so the receive is then posted from each
    other member in turn until one times out."""

    def stop(dead_world_rank: int) -> None:
        me = dist.get_rank(group)
        dead = dist.get_group_rank(group, dead_world_rank)
        others = [r for r in range(dist.get_world_size(group)) if r not in (me, dead)]
        for src in [dead, *others]:
            try:
                work = dist.irecv(
                    torch.empty(1, device=device), group=group, group_src=src, tag=_STOP_TAG
                )
                if work is not None:
                    work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError as err:
                # Classified as translate_failure does: a lost peer is not a timeout.
                message = str(err)
                if says_timed_out(message) and not says_peer_lost(message):
                    return  # the context is failed: every pending wait raises

    return stop


PEER_WATCH = _PeerWatch()
"""The process's watch (its thread starts with the first wait)."""

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
wait that ends within the interval never costs a store read.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from commfuse.comm.errors import says_peer_lost, says_timed_out

if TYPE_CHECKING:
    from commfuse.comm.handle import FailureBoard

WATCH_INTERVAL_S = 0.5
"""Seconds between two reads of the job's failure notice while a wait goes on: how late, at
most, a rank learns of a death its own sockets do not show (one store round trip each)."""


class PeerWatch:
    """The thread that reads the failure notice of the groups with a blocked wait.

    A wait registers with ``add`` and leaves with ``remove``: a plain lock and a counter, so a
    wait costs about a microsecond more (the thread polls at ``WATCH_INTERVAL_S`` rather than
    being woken, which would cost a thread switch per wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[FailureBoard, int] = {}
        self._thread: threading.Thread | None = None

    def add(self, board: FailureBoard) -> None:
        """Count a wait of ``board``'s group as blocked (until ``remove``)."""
        with self._lock:
            self._waiting[board] = self._waiting.get(board, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="commfuse-peer-watch", daemon=True
                )
                self._thread.start()

    def remove(self, board: FailureBoard) -> None:
        with self._lock:
            left = self._waiting[board] - 1
            if left:
                self._waiting[board] = left
            else:
                del self._waiting[board]

    def _run(self) -> None:
        seen: set[FailureBoard] = set()
        while True:
            time.sleep(WATCH_INTERVAL_S)
            with self._lock:
                waiting = {board for board in self._waiting if not board.stopped}
            # A board read only once it has waited a whole interval: a wait that ends within
            # one never costs a store read.
            for board in waiting & seen:
                # The watch outlives any one group: a store that went away (the launcher is
                # gone, the job is ending) leaves that group's waits to their deadlines.
                with contextlib.suppress(Exception):
                    board.member_failure()
            seen = waiting


STOP_TAG = 0x7FFF_FFF0
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
                    torch.empty(1, device=device), group=group, group_src=src, tag=STOP_TAG
                )
                if work is not None:
                    work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError as err:
                # Classified as translate_failure does: a lost peer is not a timeout.
                message = str(err)
                if says_timed_out(message) and not says_peer_lost(message):
                    return  # the context is failed: every pending wait raises

    return stop


PEER_WATCH = PeerWatch()
"""The process's watch (its thread starts with the first wait)."""

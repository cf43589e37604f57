"""The cross-replica process group: torchft's reconfigurable gloo group, plus an alarm.

torchft's Manager reconfigures this group at every quorum change (``configure``: a new gloo
group over the quorum's replica groups, rendezvous in the quorum's store). When a replica dies
inside a ring allreduce, only its neighbours see its sockets close; the others wait on a live
peer that has itself given up, until gloo's timeout, since aborting a gloo group does not
close its connections. So a replica whose collective fails raises an alarm in the quorum's
store (``raise_alarm``), and every replica waits for its collectives with ``wait``, which also
watches the alarm: all of them abandon the collective within one poll of each other, and the
Manager builds a fresh group at the next quorum. The abandoned group is kept, not destroyed:
its destructor would wait for the abandoned collective's threads until gloo's timeout.

The Manager reconfigures only when the quorum's id changes, that is when its members do. A
collective can fail without that (a peer timed out but kept its heartbeat; a member's own
reconfiguration failed), and the group is then broken, or never built, with the alarm still
raised in its store. ``renew`` makes the next configuration of the same quorum build a fresh
group under a fresh prefix of the quorum's store (``.../renewal{n}``): every member of a
quorum sees the same failed commits, so each counts the same renewals.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commfuse.ft.require import require_torchft

require_torchft()
from torchft.process_group import ProcessGroupGloo, create_store_client  # noqa: E402

#: The alarm's key in the quorum's store.
_ALARM_KEY = "commfuse/collective_failed"


class CollectiveAbandoned(RuntimeError):
    """A peer raised the alarm: its part of this collective failed."""


class AlarmedProcessGroupGloo(ProcessGroupGloo):  # type: ignore[misc]
    """torchft's ``ProcessGroupGloo`` with the quorum-wide alarm (see the module docstring).

    Args:
        timeout: gloo's timeout and the store client's.
        poll_s: how often a waiting collective looks at the alarm.
    """

    def __init__(self, *, timeout: timedelta, poll_s: float = 0.02) -> None:
        super().__init__(timeout=timeout)
        self._poll_s = poll_s
        self._alarm: Any = None
        self._abandoned: list[Any] = []
        self._quorum_id: int | None = None
        self._renewals = 0

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """torchft's reconfiguration, plus a client of the quorum's store for the alarm."""
        self._alarm = None
        if quorum_id != self._quorum_id:
            self._quorum_id, self._renewals = quorum_id, 0
        if self._renewals:
            store_addr = f"{store_addr}/renewal{self._renewals}"
        if self._pg is not None:
            # Destroying a gloo group joins its threads, which wait out gloo's timeout inside
            # a collective we abandoned: keep the old group (a few per failure) instead.
            self._abandoned.append(self._pg)
        super().configure(
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
        )
        self._alarm = create_store_client(store_addr, timeout=self._timeout)

    @property
    def quorum(self) -> list[int] | None:
        """Which group this is: ``[quorum id, renewals]`` of its last configuration (None
        before the first). Two replicas' collectives met iff their groups' ``quorum`` match."""
        return None if self._quorum_id is None else [self._quorum_id, self._renewals]

    def members(self) -> int:
        """Replica groups in the configured group, or 1 when none is configured: the
        Manager's configuration failed (a peer died during it; torchft drops the old group
        first), which the Manager records as the step's error, so the step sends nothing and
        does not commit. (``size()`` asserts a configured group.)"""
        return 1 if self._pg is None else int(self.size())

    def renew(self) -> None:
        """Build a fresh group at the next configuration, even of the same quorum (see the
        module docstring); the caller makes the Manager reconfigure."""
        self._renewals += 1

    def raise_alarm(self) -> None:
        """Tell every replica of this quorum to abandon the collective in flight."""
        if self._alarm is not None:
            # A store gone with its host: the peers see the failure themselves.
            with contextlib.suppress(RuntimeError, OSError):
                self._alarm.set(_ALARM_KEY, b"1")

    def alarmed(self) -> bool:
        """Whether a replica of this quorum raised the alarm."""
        if self._alarm is None:
            return False
        try:
            return bool(self._alarm.check([_ALARM_KEY]))
        except (RuntimeError, OSError):
            return True  # the quorum's store is unreachable: so is the quorum

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work``; raise its error, or ``CollectiveAbandoned`` on the alarm.

        Raises:
            CollectiveAbandoned: another replica of the quorum raised the alarm.
            RuntimeError: the collective failed here (gloo's error).
        """
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _: finished.set())
        while not finished.wait(self._poll_s):
            if self.alarmed():
                raise CollectiveAbandoned("a peer's part of this collective failed")
        work.wait()

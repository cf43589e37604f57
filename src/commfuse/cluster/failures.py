"""The job's failure notice: which rank failed first, kept in the job's rendezvous store.

When a rank dies in the middle of a collective, only the ranks that talk to it directly see
their sockets close; a rank further round a ring waits on a neighbour that is alive but stuck,
and would otherwise wait for its deadline and then blame that neighbour. So the first fact
about a failure is written once to the store every rank already shares, and every later error
names the rank it came from:

1. the launcher (``commfuse launch``, ``commfuse.cluster.run``) sees a rank process exit and
   posts ``rank R exited ...`` at once;
2. a rank whose point-to-point peer vanished posts ``rank P lost by rank Q during OP`` before
   it raises;
3. the first notice wins (an atomic compare-and-set), so a rank that fails *because* a
   neighbour gave up reads the root cause instead of posting the neighbour.

The key lives in the job's store itself, below every prefix torch puts on it (``root_store``),
so ranks reach it from the default process group's store and the launcher from its own server
object. A store serves one job (torchrun's agent makes a new one per restart); the test pool,
which re-forms its group on one store, clears the notice when it does (``clear_failure``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch._C._distributed_c10d import PrefixStore, Store

if TYPE_CHECKING:
    from commfuse.cluster.supervisor import RankFailure

_NOTICE_KEY = "commfuse/first_failure"
"""The store key of the notice."""


@dataclasses.dataclass(frozen=True)
class FailureNotice:
    """The first failure of a job: the (world) rank that failed, and how it was seen."""

    rank: int
    detail: str
    """How it failed, as its reporter saw it: ``was killed by SIGKILL``, ``lost by rank 2
    during allreduce.ring``."""

    def encode(self) -> str:
        return f"{self.rank} {self.detail}"

    @classmethod
    def decode(cls, raw: bytes) -> FailureNotice:
        rank, _, detail = raw.decode("utf-8", errors="replace").partition(" ")
        return cls(int(rank), detail)


def post_failure(store: Store, notice: FailureNotice) -> FailureNotice:
    """Post ``notice`` unless one is there already; returns the notice that stands."""
    return FailureNotice.decode(store.compare_set(_NOTICE_KEY, "", notice.encode()))


def read_failure(store: Store, *, wait_s: float = 0.0) -> FailureNotice | None:
    """The job's notice, polling up to ``wait_s`` for one; None if there is none (or the
    store is gone, as when the launcher itself died: then nobody can say more)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([_NOTICE_KEY]):
                return FailureNotice.decode(store.get(_NOTICE_KEY))
        except (RuntimeError, ValueError):  # the store's server is unreachable
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def root_store(store: Store) -> Store:
    """``store`` without the prefixes torch's process groups put on it (``default_pg/0/``)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def clear_failure(store: Store) -> None:
    """Remove the notice (a group re-formed on the same store starts with a clean slate)."""
    with contextlib.suppress(RuntimeError):
        store.delete_key(_NOTICE_KEY)


def notice_poster(hosted: Store | None) -> Callable[[RankFailure], None]:
    """What a launcher hosting ``hosted`` (its TCPStore server) does when a rank exits with a
    failure: post it as the job's notice, unless a rank posted the root cause first."""

    def post(failure: RankFailure) -> None:
        if hosted is None:
            return
        notice = FailureNotice(failure.rank, f"(host {failure.host}) {failure.how()}")
        with contextlib.suppress(RuntimeError):  # the job's store is closing: nobody to tell
            post_failure(hosted, notice)

    return post

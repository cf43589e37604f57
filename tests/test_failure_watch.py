"""Waits that a death leaves blocked end as soon as the job's failure notice names the dead rank.

A rank whose peer is alive but silent (stuck behind the dead one, or on a host whose link is
gone) sees no socket close. On real gloo groups of 3 ranks, the notice is posted by hand
(``post_failure``, as the launcher does when a rank exits) while a wait is blocked on the rank
it names, and the wait must end with ``PeerFailureError`` naming that rank within a few seconds
of the post, far inside the 30 s deadline: a point-to-point receive (woken by the watch thread),
a native collective (its sliced wait) and one of commfuse's own collectives queued on the worker
thread. A notice naming a rank outside a sub-group leaves that sub-group's work alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from commfuse import collectives as C
from commfuse.cluster.failures import FailureNotice, clear_failure, post_failure, root_store
from commfuse.comm import CommConfig, Communicator, PeerFailureError
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]

SILENT = 1
"""The rank named dead: alive, but it never takes part."""
POST_AFTER_S = 1.0
DEADLINE_S = 30.0
DONE_KEY = "test_failure_watch/done"
POSTED_KEY = "test_failure_watch/posted"


def _store() -> Store:
    return root_store(dist.distributed_c10d._get_default_store())


def blocked_until_named(kind: str) -> tuple[str, float, int | None]:
    """Ranks other than ``SILENT`` wait on work that needs it; ``SILENT`` posts the notice that
    names itself after ``POST_AFTER_S``, then clears it once the others are done. Returns the
    error type, the seconds from the post to the error, and the rank the error names."""
    comm = Communicator(config=CommConfig(deadline_s=DEADLINE_S, validate=False))
    store = _store()
    if comm.rank == SILENT:
        time.sleep(POST_AFTER_S)
        store.set(f"{POSTED_KEY}/{kind}", str(time.monotonic()))
        post_failure(store, FailureNotice(SILENT, "was named dead by the test"))
        store.wait([f"{DONE_KEY}/{kind}/{r}" for r in range(comm.world_size) if r != SILENT])
        clear_failure(store)
        return ("", 0.0, None)
    buf = torch.ones(1 << 10)
    try:
        if kind == "recv":
            comm.recv(buf, SILENT)
        elif kind == "native":
            comm.all_reduce(buf)
        else:
            handle = C.all_reduce(comm, buf, "sum", algo="ring", async_op=True)
            assert handle is not None
            handle.wait()
        outcome: tuple[str, float, int | None] = ("no error", 0.0, None)
    except PeerFailureError as err:
        posted = float(store.get(f"{POSTED_KEY}/{kind}"))
        outcome = (type(err).__name__, time.monotonic() - posted, err.failed_rank)
    except Exception as err:  # the test reports what else came
        outcome = (f"{type(err).__name__}: {err}", 0.0, None)
    store.set(f"{DONE_KEY}/{kind}/{comm.rank}", "1")
    return outcome


@pytest.mark.parametrize("kind", ["recv", "native", "ring-on-worker"])
def test_a_wait_on_a_rank_named_dead_ends_within_the_watch_interval(
    pool: PoolFn, kind: str
) -> None:
    results = pool(3).run(blocked_until_named, kind, timeout_s=60)
    for rank in (0, 2):
        error, seconds, failed = results[rank]
        assert error == "PeerFailureError" and failed == SILENT, (rank, results[rank])
        # The watch reads the notice every 0.5 s; the store round trips and the slices take
        # the rest. The deadline is 30 s.
        assert seconds < 5.0, (rank, seconds)


def named_outside_the_subgroup() -> bool | None:
    """Ranks 0 and 2 exchange over their own sub-group while the notice names rank 1; the
    exchange must complete (rank 2 sends only after the notice is up)."""
    comm = Communicator(config=CommConfig(deadline_s=DEADLINE_S))
    store = _store()
    pair = comm.split([[0, 2], [1]])
    if comm.rank == SILENT:
        post_failure(store, FailureNotice(SILENT, "was named dead by the test"))
        store.set(f"{POSTED_KEY}/outside", "1")
        store.wait([f"{DONE_KEY}/outside/0"])
        clear_failure(store)
        return None
    store.wait([f"{POSTED_KEY}/outside"])
    buf = torch.zeros(1 << 10)
    if comm.rank == 0:
        pair.recv(buf, 1)  # the pair's rank 1 is world rank 2
        ok = bool((buf == 7).all())
        store.set(f"{DONE_KEY}/outside/0", "1")
        return ok
    time.sleep(2.0)  # past a few of the watch's reads
    pair.send(torch.full((1 << 10,), 7.0), 0)
    return True


def test_a_notice_naming_a_rank_outside_a_subgroup_leaves_its_work_alone(pool: PoolFn) -> None:
    results = pool(3).run(named_outside_the_subgroup, timeout_s=60)
    assert results[0] is True and results[2] is True, results

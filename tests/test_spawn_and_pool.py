"""The test harness: ``commfuse.cluster.run`` (fresh ranks per call) and the persistent RankPool.

A function runs on all ranks and returns each rank's result in rank order, or raises the first
failing rank's exception (``RankError``: rank number, original exception in ``.exc``, remote
traceback); every call has a deadline, and a rank that misses it is named in DeadlineExceeded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commfuse.cluster import DeadlineExceeded, RankError, run
from commfuse.testing import RankPool

# ---- rank functions (module level, so spawned ranks can import them) ---------------------------


class Boom(Exception):
    """A test-only exception type, to check the original type travels back."""


def whoami(scale: int) -> dict[str, object]:
    """This rank's view of the job, and a sum all-reduced over the default group."""
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "env_world": int(os.environ["WORLD_SIZE"]),
        "sum": int(total.item()) * scale,
    }


def _explode(rank: int) -> None:
    raise Boom(f"exploded on rank {rank}")


def fail_on(bad_rank: int, others_wait: bool) -> int:
    """``bad_rank`` raises Boom; the others return, or wait in a barrier the bad rank never joins."""
    rank = dist.get_rank()
    if rank == bad_rank:
        _explode(rank)
    if others_wait:
        dist.barrier()
    return rank


def hang_on(bad_rank: int) -> int:
    """``bad_rank`` hangs (outside any collective); the others return at once."""
    rank = dist.get_rank()
    if rank == bad_rank:
        time.sleep(600)
    return rank


# ---- commfuse.cluster.run -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_run_returns_results_in_rank_order() -> None:
    results = run(whoami, 10, world_size=3, timeout_s=40)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["env_rank"] == r["rank"] and r["world"] == r["env_world"] == 3 for r in results)
    assert all(r["sum"] == 60 for r in results)


@pytest.mark.timeout(120)
def test_run_world_size_one() -> None:
    assert run(whoami, 1, world_size=1, timeout_s=40) == [
        {"rank": 0, "world": 1, "env_rank": 0, "env_world": 1, "sum": 1}
    ]


@pytest.mark.timeout(120)
def test_run_raises_the_failing_rank_with_its_exception_and_traceback() -> None:
    # Rank 0 waits in a barrier rank 1 never joins: it must be stopped, not left until the
    # backend's timeout (60 s here).
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run(fail_on, 1, True, world_size=2, timeout_s=40)
    err = info.value
    assert time.monotonic() - start < 45
    assert err.rank == 1
    assert isinstance(err.exc, Boom) and str(err.exc) == "exploded on rank 1"
    assert "_explode" in err.remote_traceback and "fail_on" in err.remote_traceback
    assert str(err).startswith("rank 1: Boom: exploded on rank 1")


@pytest.mark.timeout(120)
def test_run_deadline_names_the_hung_rank() -> None:
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        # The deadline covers start-up too (torch import, process group), which took over 15 s
        # on 2 cores at a load average of 14 (rank 0 was then named as well); 30 s keeps rank 0
        # clear of it.
        run(hang_on, 1, world_size=2, timeout_s=30)
    assert time.monotonic() - start < 60
    assert info.value.ranks == [1]
    assert "hang_on" in str(info.value) and "[1]" in str(info.value)


def environment_of_interest() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("COMMFUSE_TEST_ADDED", "COMMFUSE_TEST_REMOVED")}


@pytest.mark.timeout(120)
def test_a_rank_sees_the_callers_environment_of_the_call_not_of_the_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ranks fork from a server started at the first call, with the environment of then; each
    # call's ranks must still see the caller's environment as it is at that call.
    monkeypatch.setenv("COMMFUSE_TEST_REMOVED", "stale")
    monkeypatch.delenv("COMMFUSE_TEST_ADDED", raising=False)
    first = run(environment_of_interest, world_size=1, timeout_s=40)
    assert first == [{"COMMFUSE_TEST_ADDED": None, "COMMFUSE_TEST_REMOVED": "stale"}]
    monkeypatch.delenv("COMMFUSE_TEST_REMOVED")
    monkeypatch.setenv("COMMFUSE_TEST_ADDED", "fresh")
    assert run(environment_of_interest, world_size=2, timeout_s=40) == 2 * [
        {"COMMFUSE_TEST_ADDED": "fresh", "COMMFUSE_TEST_REMOVED": None}
    ]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_run_killed_takes_its_ranks_with_it() -> None:
    # The ranks lead their own sessions: only the job's watchdog can stop them once the process
    # that called run() is gone without cleaning up (SIGKILL).
    script = Path(__file__).parent / "scripts" / "spawn_and_sleep.py"
    driver = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        for line in driver.stdout or []:
            if match := re.search(r"RANK_PID (\d+)", line):
                pids.append(int(match.group(1)))
            if len(pids) == 2:
                break
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=15)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)], "ranks outlived the killed driver"
    finally:
        driver.kill()
        driver.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- the persistent pool ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_pool_results_then_failure_then_works_again(pool: Callable[[int], RankPool]) -> None:
    ranks = pool(2)
    results = ranks.run(whoami, 2, timeout_s=30)
    assert [(r["rank"], r["sum"]) for r in results] == [(0, 6), (1, 6)]

    with pytest.raises(RankError) as info:
        ranks.run(fail_on, 0, False, timeout_s=30)
    err = info.value
    assert err.rank == 0
    assert isinstance(err.exc, Boom) and "exploded on rank 0" in str(err)
    assert "_explode" in err.remote_traceback
    assert err.partial_results == {1: 1}

    # The pool is usable right away, with a working process group.
    assert [r["sum"] for r in ranks.run(whoami, 1, timeout_s=30)] == [3, 3]


@pytest.mark.timeout(120)
def test_pool_deadline_names_the_hung_rank_then_works_again(
    pool: Callable[[int], RankPool],
) -> None:
    ranks = pool(2)
    ranks.run(whoami, 1, timeout_s=30)  # started and healthy
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        ranks.run(hang_on, 1, timeout_s=2)
    assert time.monotonic() - start < 30
    assert info.value.ranks == [1]
    assert "hang_on" in str(info.value) and "[1]" in str(info.value)
    # The stuck ranks were replaced: the next call works.
    assert [r["sum"] for r in ranks.run(whoami, 1, timeout_s=60)] == [3, 3]


@pytest.mark.timeout(120)
def test_pool_world_size_one(pool: Callable[[int], RankPool]) -> None:
    assert pool(1).run(whoami, 5, timeout_s=30) == [
        {"rank": 0, "world": 1, "env_rank": 0, "env_world": 1, "sum": 5}
    ]
    with pytest.raises(RankError) as info:
        pool(1).run(fail_on, 0, False, timeout_s=30)
    assert info.value.rank == 0 and isinstance(info.value.exc, Boom)
    assert pool(1).run(hang_on, 1, timeout_s=30) == [0]

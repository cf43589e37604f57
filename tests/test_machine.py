"""The ranks' busy-CPU counter that ``compare`` and ``bench strategies`` turn into a step's CPU
floor: it counts the given processes, their children and the kernel's softirqs, and nothing else
that runs on the machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from commfuse.cluster import machine
from commfuse.testing import RankPool

#: A process that spins until it has used SECONDS of CPU, then prints "done" and waits for stdin.
SPIN = """
import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
print("done", flush=True)
sys.stdin.read()
"""

#: A process that runs a spinning child to its end (reaped: its CPU is the parent's cutime). The
#: child's "done" goes nowhere: on the parent's stdout it would be read as the parent's, before
#: the parent has reaped the child.
PARENT = """
import subprocess, sys
subprocess.run(
    [sys.executable, "-c", sys.argv[1], sys.argv[2]],
    input=b"", stdout=subprocess.DEVNULL, check=True,
)
print("done", flush=True)
sys.stdin.read()
"""


def start(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def wait_done(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "done"


def stop(proc: subprocess.Popen[str]) -> None:
    proc.communicate("")


def test_the_ranks_own_cpu_counts_and_another_programs_does_not() -> None:
    idle = start("import sys; print('done', flush=True); sys.stdin.read()")
    wait_done(idle)
    rank_before = machine.process_cpu_s([idle.pid])
    other = start(SPIN, "0.4")  # busy, but not one of the "ranks"
    try:
        wait_done(other)
        rank_after = machine.process_cpu_s([idle.pid])
        other_cpu = machine.process_cpu_s([other.pid])
    finally:
        stop(other)
        stop(idle)
    assert rank_before is not None and rank_after is not None and other_cpu is not None
    assert other_cpu >= 0.35  # the spinner's own 0.4 s, wherever the scheduler put it
    assert rank_after - rank_before < 0.05  # none of it is the idle rank's


def test_a_reaped_child_counts_for_its_parent() -> None:
    assert machine.process_cpu_s([]) == 0.0
    parent = start(PARENT, SPIN, "0.3")
    try:
        wait_done(parent)
        reaped = machine.process_cpu_s([parent.pid])
    finally:
        stop(parent)
    assert reaped is not None and reaped >= 0.25  # the child's CPU, in the parent's cutime


def test_descendants_are_found_from_the_rank() -> None:
    before = machine.process_cpu_s([os.getpid()])
    child = start(SPIN, "0.3")
    try:
        wait_done(child)
        during = machine.process_cpu_s([os.getpid()])  # the child is alive: found via /proc
    finally:
        stop(child)
    assert before is not None and during is not None
    assert during - before >= 0.25


def test_busy_is_processes_plus_softirq_and_unknown_pids_are_none() -> None:
    softirq = machine.softirq_s()
    assert softirq is not None and softirq >= 0
    busy = machine.busy_cpu_s([])
    assert busy is not None and busy >= softirq
    spin_until = time.process_time() + 0.3
    before = machine.busy_cpu_s([os.getpid()])
    while time.process_time() < spin_until:
        pass
    delta = machine.busy_since(before, [os.getpid()])
    assert delta is not None and delta >= 0.25
    ended = start("print('done')")
    wait_done(ended)
    ended.wait()
    assert machine.process_cpu_s([ended.pid]) is None
    assert machine.busy_since(before, [ended.pid]) is None
    assert machine.cores() >= 1


def test_rank_pids_without_a_process_group_is_this_process() -> None:
    assert machine.rank_pids() == (os.getpid(),)
    assert "/" in machine.machine_id()


def rank_pids_on_rank() -> tuple[int, tuple[int, ...]]:
    return os.getpid(), machine.rank_pids()


def test_ranks_of_one_machine_find_each_other(pool: Callable[[int], RankPool]) -> None:
    results = pool(3).run(rank_pids_on_rank)
    pids = tuple(pid for pid, _ in results)
    assert all(found == pids for _, found in results)


def test_core_times_account_for_every_core_of_an_interval() -> None:
    # Over an interval every core is busy, idle or stolen: their sum is the interval times the
    # cores, within a few ticks per core (busy time is sampled at each tick, idle time on a
    # tickless kernel measured, so the two drift apart by some ticks over a loaded interval;
    # a core or a state left out would miss by half or more); a spin of 0.3 s shows in busy.
    before, start = machine.core_times_s(), time.monotonic()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    time.sleep(0.2)
    after, elapsed = machine.core_times_s(), time.monotonic() - start
    assert before is not None and after is not None
    delta = {kind: after[kind] - before[kind] for kind in machine.CORE_TIMES}
    cores, tick = machine.cores(), 1.0 / os.sysconf("SC_CLK_TCK")
    total = delta["busy"] + delta["idle"] + delta["steal"]
    assert abs(total - elapsed * cores) <= 2 * tick * cores + 0.1 * elapsed * cores
    assert delta["busy"] >= 0.3 - 2 * tick * cores
    assert 0 <= delta["softirq"] <= delta["busy"] and delta["steal"] >= 0


def test_cpu_by_owner_splits_the_ranks_from_other_programs_and_keeps_reaped_children() -> None:
    before = machine.cpu_by_owner_s([os.getpid()])
    # A child of this "rank" that ends and is reaped inside the interval: its CPU leaves the
    # listing of /proc and comes back in this process's cutime.
    subprocess.run([sys.executable, "-c", SPIN, "0.3"], input="", text=True, check=True)
    other = start(SPIN, "0.3")  # alive at the second reading, and no rank
    try:
        wait_done(other)
        after = machine.cpu_by_owner_s([os.getpid()])
    finally:
        stop(other)
    assert before is not None and after is not None and set(after) == {"ranks", "others"}
    assert after["ranks"] - before["ranks"] >= 0.25
    assert after["others"] - before["others"] >= 0.25

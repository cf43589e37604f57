"""How busy the ranks keep the machine under them: the CPU floor of a step where ranks share cores.

On the emulated cluster every rank, every gloo thread and the kernel's work for every emulated
link (the copies through veth pairs, the bridge, tbf) share one machine's cores. A step then
cannot be shorter than the CPU all of that needs divided by the cores, however well
communication overlaps computation: ``busy CPU seconds / cores`` is the floor that overlap
cannot beat, and a step close to it is CPU-bound, not network-bound.

The busy CPU is counted over the ranks' own processes, so that another program on the machine
(a test suite, a compiler) cannot make a strategy look CPU-bound:

1. every rank process of this machine (``rank_pids``: the ranks exchange their pid and machine
   once) and its descendants: ``utime + stime`` of ``/proc/PID/stat`` (all its threads: gloo's,
   commfuse's workers) plus ``cutime + cstime`` (children it has reaped);
2. plus the kernel's softirq time from ``/proc/stat``: network receive and transmit processing
   (the veth pairs, the bridge, tbf), work the kernel does on the ranks' behalf, often on no
   rank's clock. It is the whole machine's, so another program's network traffic counts too.

Where the kernel accounts CPU time by ticks without ``CONFIG_IRQ_TIME_ACCOUNTING``, a tick that
interrupts a rank inside a softirq is charged both to that rank's ``stime`` and to softirq, so
the sum can overstate the busy time by up to the softirq share: an upper bound there, exact
with IRQ time accounting. Counters are in clock ticks (10 ms): time blocks of a second or more.
Everything is ``None`` where ``/proc`` does not exist (not Linux).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = [
    "busy_cpu_s",
    "busy_since",
    "core_times_s",
    "cores",
    "cpu_by_owner_s",
    "machine_id",
    "process_cpu_s",
    "rank_pids",
    "softirq_s",
]

#: The field of ``/proc/stat``'s ``cpu`` line that holds softirq ticks (after the label).
_SOFTIRQ = 6


def _tick() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def _own_and_children_ticks(pid: int) -> int | None:
    """utime + stime + cutime + cstime of ``pid`` in ticks; None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime, stime, cutime, cstime are fields 14-17.
    return sum(int(v) for v in fields[11:15])


def _children(pid: int) -> list[int]:
    """Live children of ``pid`` (any of its threads may have started one)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as children:
                out += [int(c) for c in children.read().split()]
        except OSError:
            continue  # the thread ended meanwhile, or no CONFIG_PROC_CHILDREN
    return out


def process_cpu_s(pids: Iterable[int]) -> float | None:
    """CPU seconds that ``pids`` and all their descendants have used (every thread, user and
    system, plus reaped children); None if one of ``pids`` cannot be read."""
    seen: set[int] = set()
    todo = list(pids)
    roots = set(todo)
    ticks = 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        own = _own_and_children_ticks(pid)
        if own is None:
            if pid in roots:
                return None
            continue  # a descendant that ended between listing and reading
        ticks += own
        todo += _children(pid)
    return ticks / _tick()


def softirq_s() -> float | None:
    """Seconds the whole machine has spent in softirqs since boot (all cores): mostly network
    processing; None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) <= _SOFTIRQ + 1 or fields[0] != "cpu":
        return None
    return int(fields[_SOFTIRQ + 1]) / _tick()


#: ``core_times_s``'s keys and the ``/proc/stat`` fields (after the label) each sums: busy is
#: user, nice, system, irq and softirq; idle is idle and iowait; steal is the time the
#: hypervisor ran something else while a core of this virtual machine had work.
CORE_TIMES = {"busy": (0, 1, 2, 5, 6), "idle": (3, 4), "softirq": (6,), "steal": (7,)}


def core_times_s() -> dict[str, float] | None:
    """Core seconds of the whole machine since boot, all cores, by ``CORE_TIMES``'s kinds: over
    an interval, ``busy + idle + steal`` is the interval times the cores (to a few ticks per
    core: busy time is sampled at each tick, idle time on a tickless kernel measured); None
    without ``/proc/stat``."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) <= 8 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    return {kind: sum(ticks[i] for i in at) / _tick() for kind, at in CORE_TIMES.items()}


#: ``PF_KTHREAD``: the bit of ``/proc/PID/stat``'s flags (field 9) that marks a kernel thread.
_PF_KTHREAD = 0x00200000


def cpu_by_owner_s(ranks: Iterable[int]) -> dict[str, float] | None:
    """CPU seconds used since boot by the processes ``ranks`` (``"ranks"``) and by every other
    user-space process of this pid namespace (``"others"``), each with its reaped children
    (``cutime + cstime``); kernel threads (``ksoftirqd``, ``kworker``) are in neither. None
    without ``/proc``.

    Over an interval, the difference of two readings is exact to the ticks: a process that
    ends within it leaves the sum with the CPU it had at the first reading and comes back, whole,
    in the ``cutime`` of whoever reaps it. The rest of the machine's busy time
    (``core_times_s``) is the kernel's own: its threads and the interrupts and softirqs that ran
    on an idle core. A process that ends between the listing of ``/proc`` and the reading of its
    file is missed for that reading (a rare error of its whole CPU, either sign)."""
    mine = set(ranks)
    totals = {"ranks": 0, "others": 0}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state): flags (field 9) is fields[6], utime..cstime fields[11:15].
        if int(fields[6]) & _PF_KTHREAD:
            continue
        totals["ranks" if pid in mine else "others"] += sum(int(v) for v in fields[11:15])
    return {owner: ticks / _tick() for owner, ticks in totals.items()}


def busy_cpu_s(pids: Iterable[int]) -> float | None:
    """CPU seconds spent by ``pids`` (and descendants) plus the machine's softirq time: the
    reading that ``busy_since`` subtracts. None where either part is unknown."""
    processes = process_cpu_s(pids)
    kernel = softirq_s()
    return None if processes is None or kernel is None else processes + kernel


def busy_since(before: float | None, pids: Iterable[int]) -> float | None:
    """Busy CPU seconds of ``pids`` and the kernel's softirqs since ``before`` (a
    ``busy_cpu_s(pids)`` reading); None if either reading is unknown."""
    now = busy_cpu_s(pids)
    return None if before is None or now is None else now - before


def machine_id() -> str:
    """Names this machine and pid namespace: ranks with the same id can read each other's
    ``/proc/PID`` (the emulated hosts share one; real hosts and containers differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"pid-{os.getpid()}"  # unknown: this rank alone
    return f"{boot_id}/{namespace}"


def rank_pids() -> tuple[int, ...]:
    """The pids of every rank on this machine (this one included), in rank order. A collective:
    every rank of the default process group must call it (once, outside any timed region)."""
    import torch.distributed as dist

    mine = (machine_id(), os.getpid())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return (mine[1],)
    everyone: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return tuple(entry[1] for entry in everyone if entry is not None and entry[0] == mine[0])


def cores() -> int:
    """Cores of the machine (all of them: ``/proc/stat`` counts all)."""
    return os.cpu_count() or 1


#: The fewest cores a machine floor divides by: other programs' share is measured over ticks
#: of 10 ms, and a reading of nearly every core must not send the floor to infinity.
MIN_CORES = 0.25


def cores_left(cores: float, taken: float) -> float:
    """The cores a floor divides by: a machine's ``cores`` less those ``taken`` by other
    programs (the kernel, the hypervisor), never fewer than ``MIN_CORES``."""
    return max(cores - taken, MIN_CORES)

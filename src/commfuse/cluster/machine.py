"""How busy the machine under the ranks is: the CPU floor of a step where ranks share cores.

On the emulated cluster every rank, every gloo thread and the kernel's work for every emulated
link (the copies through veth pairs, the bridge, tbf) share one machine's cores. A step then
cannot be shorter than the CPU all of that needs divided by the cores, however well
communication overlaps computation: ``busy CPU seconds / cores`` is the floor that overlap
cannot beat, and a step close to it is CPU-bound, not network-bound. Read from ``/proc/stat``
(all CPUs, everything but idle and iowait, in clock ticks of 10 ms, so time blocks of a second or
more); ``None`` where the file does not exist (not Linux).
"""

from __future__ import annotations

import os


def busy_cpu_s() -> float | None:
    """CPU seconds this machine has spent busy since boot (all cores, user + system + irq ...)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:8]]  # user nice system idle iowait irq softirq
    busy = sum(ticks) - ticks[3] - ticks[4]
    if len(fields) > 8:
        # steal: time the hypervisor gave a vCPU's core to another guest; the ranks could not
        # use it either, so for the floor it counts as taken
        busy += int(fields[8])
    return busy / os.sysconf("SC_CLK_TCK")


def busy_since(before: float | None) -> float | None:
    """Busy CPU seconds of the machine since ``before`` (a ``busy_cpu_s`` reading); None if
    either reading is unknown."""
    now = busy_cpu_s()
    return None if before is None or now is None else now - before


def cores() -> int:
    """Cores of the machine (all of them: ``/proc/stat`` counts all)."""
    return os.cpu_count() or 1

"""The CPU floor of a step: the time the machine's cores need for the CPU work of every rank.

1. each rank measures the CPU time (user + system, all its threads: ``getrusage``) of the
   computation alone and of the communication alone, in the benchmark's rounds;
2. ranks on the same machine (the same Linux boot id, else the same host name) sum theirs;
3. the floor of a machine is that sum divided by the cores the ranks may run on
   (``os.sched_getaffinity``); the step's floor is the largest over machines.

This floor (``cpu_floor_us``) leaves out two things the machine makes a step pay:

* the kernel's network work that no rank is charged for: ``ksoftirqd`` and the softirqs that
  run on a core the scheduler had left idle (the rest runs inside the ranks' system calls and
  is already in their CPU). The unfused step pays it too;
* the cores other programs take: with the ranks asking for every core, the scheduler still
  gives other programs their share, and a schedule can only use what is left.

The **machine floor** (``machine_floor_us``) counts both, each from runs of the components
alone, never from the fused run (whose own waste must not lower its distance to the bound):

4. the kernel's network work of the communication alone: the machine's busy core time
   (``/proc/stat``) over the run, less every process's CPU (``cluster.machine.cpu_by_owner_s``:
   the ranks and every other user-space process), less the kernel work the machine does at the
   same rate without it (measured over the computation alone);
5. the cores the ranks had while the computation alone ran, every rank asking for a core:
   the machine's cores less the rate at which other programs, the kernel and the hypervisor
   (``steal``) took core time meanwhile;
6. the floor is ``(ranks' CPU + kernel network work) / cores the ranks had``.

Design notes: ``docs/benchmarking.md``, "The CPU floor: why, and why it stays a bound".
"""

from __future__ import annotations

import hashlib
import os
import resource
import socket
from pathlib import Path

import torch

from commfuse.cluster.machine import cores_left
from commfuse.comm import Communicator


def cpu_seconds() -> float:
    """CPU time of this process so far, user + system, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_key() -> int:
    """A number the same for every process of one machine (boot id, else host name)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    text = boot.read_text().strip() if boot.exists() else socket.gethostname()
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")


def cpu_floor_us(comm: Communicator, cpu_us: float) -> float:
    """The largest, over machines, of the CPU time ``cpu_us`` summed over a machine's ranks and
    divided by its usable cores (module docstring). Every rank must call it alike; all get the
    same answer."""
    return floor_of(_every_ranks(comm, [float(machine_key()), cpu_us, float(usable_cores())]))


def machine_floor_us(
    comm: Communicator, cpu_us: float, *, kernel_us: float = 0.0, taken_cores: float = 0.0
) -> float:
    """The machine floor (module docstring, steps 4-6): like ``cpu_floor_us``, plus the
    kernel's network work ``kernel_us`` and less the cores ``taken_cores`` that other programs,
    the kernel and the hypervisor took, each given by one rank of a machine (its reader; the
    others pass 0). Every rank must call it alike; all get the same answer."""
    mine = [float(machine_key()), cpu_us, float(usable_cores()), kernel_us, taken_cores]
    return floor_of(_every_ranks(comm, mine))


def _every_ranks(comm: Communicator, values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, in rank order (all ranks call it alike)."""
    rows = torch.zeros(comm.world_size, len(values), dtype=torch.float64, device=comm.device)
    rows[comm.rank] = torch.tensor(values, dtype=torch.float64, device=comm.device)
    comm.all_reduce(rows)  # an all-gather by sum: every other row is zero
    return rows.tolist()


def floor_of(rows: list[list[float]]) -> float:
    """``cpu_floor_us``'s arithmetic on ``[machine key, CPU us, cores]`` per rank: the CPU of the
    ranks of each machine summed, divided by that machine's cores, the largest over machines.
    Rows of ``machine_floor_us`` add ``kernel us, cores taken``: each machine's kernel work is
    added to its ranks' CPU and the cores taken are subtracted from its cores."""
    totals: dict[float, float] = {}
    cores: dict[float, float] = {}
    taken: dict[float, float] = {}
    for key, cpu, n, *extra in rows:
        kernel, lost = extra if extra else (0.0, 0.0)
        totals[key] = totals.get(key, 0.0) + cpu + kernel
        cores[key] = min(cores.get(key, n), n)
        taken[key] = taken.get(key, 0.0) + lost
    return max((totals[k] / cores_left(cores[k], taken[k]) for k in totals), default=0.0)

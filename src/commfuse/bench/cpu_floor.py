"""The CPU floor of a step: the time the machine's cores need for the CPU work of every rank.

Where several ranks share one machine's cores (the emulated cluster puts every host on the same
few cores), a step cannot finish before the cores have done all of its CPU work, however well
it overlaps: the computation of every rank, and the CPU that communication costs (gloo's
threads, the kernel copying each byte through sockets, veth pairs, the bridge and ``tbf``).
A dependency-aware bound that times the parts alone and subtracts the overlap assumes that the
communication's CPU is free while computation runs; the floor does not:

1. each rank measures the CPU time (user + system, all its threads: ``getrusage``) of the
   computation alone and of the communication alone, in the benchmark's rounds;
2. ranks on the same machine (the same Linux boot id, else the same host name) sum theirs;
3. the floor of a machine is that sum divided by the cores the ranks may run on
   (``os.sched_getaffinity``); the step's floor is the largest over machines.

CPU time charged to no rank (the kernel's network softirqs run in interrupt context or in
``ksoftirqd``) is missing from the sum, so the floor can only lie below the truth: it is a
bound, measured rather than assumed.
"""

from __future__ import annotations

import hashlib
import os
import resource
import socket
from pathlib import Path

import torch

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
    mine = torch.tensor(
        [float(machine_key()), cpu_us, float(usable_cores())],
        dtype=torch.float64,
        device=comm.device,
    )
    rows = torch.zeros(comm.world_size, 3, dtype=torch.float64, device=comm.device)
    rows[comm.rank] = mine
    comm.all_reduce(rows)  # an all-gather by sum: every other row is zero
    return floor_of(rows.tolist())


def floor_of(rows: list[list[float]]) -> float:
    """``cpu_floor_us``'s arithmetic on ``[machine key, CPU us, cores]`` per rank: the CPU of the
    ranks of each machine summed, divided by that machine's cores, the largest over machines."""
    totals: dict[float, float] = {}
    cores: dict[float, float] = {}
    for key, cpu, n in rows:
        totals[key] = totals.get(key, 0.0) + cpu
        cores[key] = min(cores.get(key, n), n)
    return max((totals[k] / max(cores[k], 1.0) for k in totals), default=0.0)

"""What a benchmark's rounds measure of the machine, and the machine floor they give.

``bench/cpu_floor.py`` states the machine floor (its steps 4-6): the ranks' CPU and the kernel's
network work of the parts of a step run alone, over the cores other programs leave the ranks.
This module measures its inputs in a benchmark's rounds, the same way for every benchmark that
divides by it (``bench/fused.py``'s operators, ``bench/fused_steps.py``'s whole steps):

1. every call is timed after a barrier (``_timed_on_machine``): its wall time, this rank's CPU,
   and, on one rank of each machine (its reader), ``/proc/stat``'s core time by kind, its ranks'
   and every other process's CPU over an interval a little longer than the call;
2. ``Rounds.finish`` takes the slowest rank's wall time, sums the ranks' CPU of each machine to
   the microsecond, and from a variant that is computation alone (``compute``) reads the
   kernel's own rate and the cores other programs, the kernel and the hypervisor took
   (``machine_share``); each variant's kernel network work is its kernel work beyond that rate;
3. ``_MachineRounds.floor(variants)`` is the machine floor of the named variants together:
   their CPU and kernel network work over the cores left (``cpu_floor.machine_floor_us``).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse.bench.cpu_floor import (
    cpu_floor_us,
    cpu_seconds,
    machine_floor_us,
    machine_key,
    usable_cores,
)
from commfuse.cluster.machine import (
    CORE_TIMES,
    core_times_s,
    cores_left,
    cpu_by_owner_s,
    rank_pids,
)
from commfuse.comm import Communicator
from commfuse.comm.clock import now

#: What a machine's reader records per call (us): ``/proc/stat``'s core time by kind
#: (``cluster.machine.CORE_TIMES``: busy, idle, softirq, steal; all cores), the CPU of the
#: machine's ranks and of every other user-space process (``cluster.machine.cpu_by_owner_s``)
#: and the interval's length.
MACHINE_KINDS = (*CORE_TIMES, "ranks", "others", "interval")


def machine_reader(comm: Communicator) -> tuple[int, ...] | None:
    """The pids of this machine's ranks where this rank reads the machine's counters (the first
    rank of its machine), else None. A collective of the default group (outside timing)."""
    pids = rank_pids()
    return pids if pids[0] == os.getpid() else None


def _machine_reading(reader: tuple[int, ...] | None) -> list[float] | None:
    if reader is None:
        return None
    owners, cores = cpu_by_owner_s(reader), core_times_s()
    if owners is None or cores is None:
        return None
    return [*(cores[k] for k in CORE_TIMES), owners["ranks"], owners["others"], time.monotonic()]


def _timed_on_machine(
    comm: Communicator, fn: Callable[[], Any], reader: tuple[int, ...] | None = None
) -> list[float]:
    """``timed_with_cpu``'s (wall us, CPU us) of one call, then, on a machine's reader
    (``reader``: its ranks' pids), what the machine did with its cores meanwhile, by
    ``MACHINE_KINDS`` (us; -1 where ``/proc`` cannot be read; 0 on other ranks): its ranks'
    CPU, other programs' CPU, the kernel's own work (busy less both), idle cores, time the
    hypervisor took. The reader reads between the two barriers before the call and after the
    one that follows it, so that no rank waits for it inside the timed call and every rank's
    CPU is counted over the same interval, a little longer than the call (``interval``). ``ranks`` is this rank's
    own CPU over it (``getrusage``, to the microsecond: the ranks' ``/proc`` times are in
    10 ms ticks), which the caller sums over the machine's ranks (``_machine_ranks_cpu``)."""
    comm.barrier()
    outer = cpu_seconds()
    before = _machine_reading(reader)
    comm.barrier()
    cpu, start = cpu_seconds(), now(comm.device)
    fn()
    wall = (now(comm.device) - start) * 1e6
    own = (cpu_seconds() - cpu) * 1e6
    comm.barrier()
    after = _machine_reading(reader)
    wide = (cpu_seconds() - outer) * 1e6
    if reader is None:
        return [wall, own, *([0.0] * len(MACHINE_KINDS)), wide]
    if before is None or after is None:
        return [wall, own, *([-1.0] * len(MACHINE_KINDS)), wide]
    counters = [(b - a) * 1e6 for a, b in zip(before, after, strict=True)]
    return [wall, own, *counters, wide]


def _machine_ranks_cpu(comm: Communicator, wide: torch.Tensor) -> torch.Tensor:
    """``wide[variant, round]`` (each rank's CPU over its machine reading's interval) summed over
    the ranks of this rank's machine (``cpu_floor.machine_key``)."""
    keys = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    keys[comm.rank] = float(machine_key())
    comm.all_reduce(keys)
    every = torch.zeros(comm.world_size, *wide.shape, dtype=torch.float64, device=comm.device)
    every[comm.rank] = wide
    comm.all_reduce(every)
    return every[keys == keys[comm.rank]].sum(0).cpu()


def _machine_medians(
    comm: Communicator, machine: torch.Tensor, names: list[str]
) -> dict[str, dict[str, float]] | None:
    """``machine[kind, variant, round]`` (``_timed_on_machine``'s ``MACHINE_KINDS``, read on each
    machine's reader, 0 elsewhere) as each kind's median over rounds per variant, of the mean
    over machines, with ``kernel`` (busy less the ranks' and other programs' CPU) added; None
    where a reader could not read them."""
    readable = torch.tensor([float(bool((machine >= 0).all()))], device=comm.device)
    comm.all_reduce(readable, "min")
    readers = torch.tensor([float(bool(machine.any()))], device=comm.device)
    comm.all_reduce(readers)
    shared = machine.to(comm.device)
    comm.all_reduce(shared)
    if not readable.item() or not readers.item():
        return None
    mean = (shared / readers).cpu()
    kinds = {kind: mean[k] for k, kind in enumerate(MACHINE_KINDS)}
    kinds["kernel"] = kinds["busy"] - kinds["ranks"] - kinds["others"]
    return {
        kind: {name: statistics.median(per[v].tolist()) for v, name in enumerate(names)}
        for kind, per in kinds.items()
    }


def machine_share(
    machine: torch.Tensor,
    names: list[str],
    reader: tuple[int, ...] | None,
    *,
    compute: str = "compute",
) -> tuple[dict[str, float], float]:
    """On a machine's reader, from its own ``machine`` readings: the kernel's network work of
    each variant (us: the kernel's work beyond what it does at the computation's rate, median
    over rounds, at least 0) and the cores taken from the ranks while the computation alone
    ran (``compute``: other programs' CPU, the kernel's and the hypervisor's steal per second
    of the interval, median over rounds); zeros elsewhere (``cpu_floor.machine_floor_us``)."""
    if reader is None or not bool((machine >= 0).all()):
        return dict.fromkeys(names, 0.0), 0.0
    k = {kind: machine[i] for i, kind in enumerate(MACHINE_KINDS)}
    kernel = k["busy"] - k["ranks"] - k["others"]
    interval = k["interval"].clamp_min(1.0)
    c = names.index(compute)
    # The kernel's own rate beside the computation (others' traffic, timers); at least 0, as
    # tick-sampled busy time can read below the ranks' exact CPU.
    rate = max(0.0, statistics.median((kernel[c] / interval[c]).tolist()))
    taken = statistics.median(
        ((k["busy"][c] - k["ranks"][c] + k["steal"][c]) / interval[c]).tolist()
    )
    network = {
        name: max(0.0, statistics.median((kernel[v] - rate * interval[v]).tolist()))
        for v, name in enumerate(names)
    }
    return network, max(0.0, taken)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MachineRounds:
    """A benchmark's rounds, reduced over ranks (``Rounds.finish``)."""

    names: list[str]
    """The variants, in the rows of ``times``."""
    times: torch.Tensor
    """``[variant, round]`` wall us of the slowest rank."""
    own_cpu_us: dict[str, float]
    """This rank's CPU per variant (median over rounds)."""
    cpu_us: dict[str, float]
    """Every rank's CPU per variant, all ranks together (median over rounds)."""
    machine_us: dict[str, dict[str, float]] | None
    """What the machine did with its cores per kind and variant (``_machine_medians``)."""
    kernel_network_us: dict[str, float]
    """The kernel's network work per variant on this rank's machine (its reader's; 0 on the
    other ranks)."""
    taken: float
    """Cores taken from the ranks on this rank's machine (its reader's; 0 on the others)."""
    taken_cores: float
    """Cores taken from the ranks, the largest over machines (every rank's the same)."""

    def cpu_floor(self, comm: Communicator, variants: Sequence[str]) -> float:
        """The CPU floor of ``variants`` together (``cpu_floor.cpu_floor_us``): the ranks' CPU
        alone. A collective: every rank calls it alike."""
        return cpu_floor_us(comm, sum(self.own_cpu_us[v] for v in variants))

    def floor(self, comm: Communicator, variants: Sequence[str]) -> float:
        """The machine floor of ``variants`` together (``cpu_floor.machine_floor_us``). A
        collective: every rank calls it alike."""
        return machine_floor_us(
            comm,
            sum(self.own_cpu_us[v] for v in variants),
            kernel_us=sum(self.kernel_network_us[v] for v in variants),
            taken_cores=self.taken,
        )

    def cores_left(self) -> float:
        """The cores a floor divides by on this rank's machine."""
        return cores_left(usable_cores(), self.taken_cores)


class Rounds:
    """Each variant's wall time, CPU and machine readings, round by round (module docstring)."""

    def __init__(
        self,
        comm: Communicator,
        names: Sequence[str],
        rounds: int,
        reader: tuple[int, ...] | None,
    ) -> None:
        self.comm, self.names, self.reader = comm, list(names), reader
        self.times = torch.zeros(len(self.names), rounds, dtype=torch.float64, device=comm.device)
        self.cpu = torch.zeros_like(self.times)
        self.machine = self.times.new_zeros(len(MACHINE_KINDS), *self.times.shape)
        self.wide = torch.zeros_like(self.times)

    def time(self, name: str, round_: int, call: Callable[[], Any]) -> None:
        """Times ``call`` as variant ``name``'s run in round ``round_`` (every rank alike)."""
        v = self.names.index(name)
        wall, own, *cores, whole = _timed_on_machine(self.comm, call, self.reader)
        self.times[v, round_], self.cpu[v, round_], self.wide[v, round_] = wall, own, whole
        self.machine[:, v, round_] = self.times.new_tensor(cores)

    def finish(self, compute: str | None) -> _MachineRounds:
        """The rounds reduced over ranks; ``compute`` names the variant that is computation
        alone (None: the kernel's network work and the cores taken are not measured, and are
        0). A collective: every rank calls it alike, once."""
        comm, names, machine = self.comm, self.names, self.machine
        comm.all_reduce(self.times, "max")
        if self.reader is not None and bool((machine >= 0).all()):
            # The ranks' CPU to the microsecond, where /proc's ticks would add their noise.
            machine[MACHINE_KINDS.index("ranks")] = _machine_ranks_cpu(comm, self.wide)
        else:
            _machine_ranks_cpu(comm, self.wide)  # a collective: every rank takes part
        machine_us = _machine_medians(comm, machine, names)
        if compute is None:
            network, taken = dict.fromkeys(names, 0.0), 0.0
        else:
            network, taken = machine_share(machine.cpu(), names, self.reader, compute=compute)
        own = {n: statistics.median(self.cpu[v].tolist()) for v, n in enumerate(names)}
        agreed = torch.tensor([taken], dtype=torch.float64, device=comm.device)
        comm.all_reduce(agreed, "max")  # the readers' (one machine: the only one)
        every = self.cpu.clone()
        comm.all_reduce(every)  # every variant's CPU, all ranks together, per round
        return _MachineRounds(
            names=names,
            times=self.times,
            own_cpu_us=own,
            cpu_us={n: statistics.median(every[v].tolist()) for v, n in enumerate(names)},
            machine_us=machine_us,
            kernel_network_us=network,
            taken=taken,
            taken_cores=float(agreed),
        )

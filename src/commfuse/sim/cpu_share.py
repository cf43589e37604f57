"""Communication that costs CPU: compute slowed by the collectives running under it.

On a real cluster a collective's bytes are moved by NICs and DMA engines, and compute (on the
GPU) runs at full speed under it: overlap is free. On the emulated cluster (``netlab``) the
network *is* the CPU: every byte crosses veths, a bridge and a tbf queue in the kernel, and gloo's
threads copy and reduce it, all on the same 2 cores as the ranks' forward and backward. So a
bucket's allreduce overlapped with backward slows the backward (the validation measured torch
DDP steps 15-30% longer than a free-overlap model).

The model (a processor-sharing view, as in the CPU models of SimGrid): a collective of payload
S bytes (nccl-tests' S) in flight from ``t0`` to ``t1`` costs each rank ``c S`` seconds of CPU,
spread evenly over its duration, i.e. a load of ``c S / (t1 - t0)`` CPU-seconds per second. A
compute task that runs for ``o`` seconds under that collective is longer by ``c S o / (t1 -
t0)``. ``c`` is ``ClusterModel.comm_cpu_us_per_mbyte`` (microseconds per 1e6 bytes). The
sharing cuts both ways (first order): while the cores are shared the collective does not run at
its alone speed either, so its end moves by the same stolen CPU time (its slowest rank's); else
a step bound by its queue of allreduces would hide any slowdown behind the queue, which is not
what the emulated cluster does. Extending tasks moves everything after them, which changes the
overlaps, so the engine is run to a fixed point (each extension is bounded by ``c S``; it
settles in a few rounds).

``c`` is fitted by ``fit_comm_cpu``: the simulated step is non-decreasing in ``c``, so the
value that makes it match a measured communicating step (of the *calibration* model, never the
validation's) is found by bisection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from commfuse.sim.engine import Timeline, simulate
from commfuse.sim.program import Task

_ROUNDS = 30
_TOLERANCE_S = 1e-7


def simulate_shared_cpu(
    tasks: Sequence[Task], world_size: int, comm_cpu_us_per_mbyte: float
) -> Timeline:
    """Run the task graph with every compute task slowed by the collectives under it (module
    docstring); with a zero coefficient this is ``engine.simulate``."""
    if comm_cpu_us_per_mbyte < 0:
        raise ValueError(f"comm_cpu_us_per_mbyte must be >= 0, got {comm_cpu_us_per_mbyte}")
    timeline = simulate(tasks, world_size)
    if comm_cpu_us_per_mbyte == 0:
        return timeline
    per_byte_s = comm_cpu_us_per_mbyte * 1e-6 / 1e6
    compute = [
        i for i, t in enumerate(tasks) if t.compute_s is not None and t.category == "compute"
    ]
    comms = [j for j, t in enumerate(tasks) if t.compute_s is None and t.nbytes > 0]
    extra = {i: np.zeros(world_size) for i in compute}
    held = dict.fromkeys(comms, 0.0)
    for _ in range(_ROUNDS):
        stolen = {j: np.zeros(world_size) for j in comms}
        change = 0.0
        for i in compute:
            lo = np.asarray(timeline.starts_s[i], dtype=np.float64)
            hi = np.asarray(timeline.ends_s[i], dtype=np.float64)
            new = np.zeros(world_size)
            for j in comms:
                t0, t1 = float(timeline.starts_s[j]), float(timeline.ends_s[j])
                if t1 > t0:
                    overlap = np.clip(np.minimum(hi, t1) - np.maximum(lo, t0), 0.0, None)
                    cpu = per_byte_s * tasks[j].nbytes * overlap / (t1 - t0)
                    new += cpu
                    stolen[j] += cpu
            change = max(change, float(np.max(np.abs(new - extra[i]))))
            extra[i] = new
        for j in comms:
            # The same cores: while they are shared, neither side runs at full speed, so the
            # collective's end moves by the CPU time its own rank lost too (its slowest rank).
            later = float(np.max(stolen[j]))
            change = max(change, abs(later - held[j]))
            held[j] = later
        slowed = [
            dataclasses.replace(t, compute_s=t.compute_s + extra[i])  # type: ignore[operator]
            if i in extra
            else dataclasses.replace(t, overhead_s=t.overhead_s + held[i])
            if i in held
            else t
            for i, t in enumerate(tasks)
        ]
        timeline = simulate(slowed, world_size)
        if change < _TOLERANCE_S:
            break
    return timeline


def fit_comm_cpu(predict: Callable[[float], float], measured_s: float) -> float:
    """The coefficient (us per MB) at which ``predict(c)`` (a step time, non-decreasing in c)
    equals ``measured_s``, by bisection; 0 when even free overlap is slower than measured.
    ValueError when no coefficient up to 1 s per MB explains the measurement (the step has too
    little compute under its communication for this model to account for the gap)."""
    if not measured_s > 0:
        raise ValueError(f"fit_comm_cpu: measured step must be > 0 seconds, got {measured_s}")
    if predict(0.0) >= measured_s:
        return 0.0
    lo, hi = 0.0, 1000.0
    while predict(hi) < measured_s:
        lo, hi = hi, hi * 4
        if hi > 1e6:
            raise ValueError(
                f"fit_comm_cpu: the step stays below the measured {measured_s * 1e3:.1f} ms "
                "even at 1 s of CPU per MB: its compute does not overlap its communication"
            )
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if predict(mid) < measured_s:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6 * hi:
            break
    return 0.5 * (lo + hi)

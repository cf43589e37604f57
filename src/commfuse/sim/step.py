"""Predict one training step: build the task graph, run the engine, break the time down.

The breakdown is the slowest rank's view: ``compute_s`` is its compute, ``exposed_comm_s`` the
rest of the step (time it spends waiting for communication), ``overlapped_comm_s`` the
communication that ran under its compute. Compute under communication is slowed by its CPU cost
(``cpu_share.py``, ``ClusterModel.comm_cpu_us_per_mbyte``; 0 on real clusters), and
``compute_s`` includes that slowdown. With local SGD the step time is the mean over one
period: ``H - 1`` steps without synchronisation and one that ends with the outer allreduce.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from commfuse.sim.cluster import ClusterModel
from commfuse.sim.cpu_share import simulate_shared_cpu
from commfuse.sim.engine import Timeline
from commfuse.sim.model import ModelProfile
from commfuse.sim.plan import CommPlan
from commfuse.sim.program import build_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    """A predicted step."""

    step_s: float
    """Step time (mean over a local-SGD period), seconds."""
    compute_s: float
    """Compute of the slowest rank, seconds."""
    exposed_comm_s: float
    """Time not covered by compute (waiting for collectives), seconds."""
    overlapped_comm_s: float
    """Communication hidden under compute, seconds."""
    comm_s: dict[str, float]
    """Time during which each kind of communication (mp, dp, outer) was in flight, seconds."""
    num_collectives: int
    timeline: Timeline
    """The synchronising step's timeline (for the trace)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_us": self.step_s * 1e6,
            "compute_us": self.compute_s * 1e6,
            "exposed_comm_us": self.exposed_comm_s * 1e6,
            "overlapped_comm_us": self.overlapped_comm_s * 1e6,
            "comm_us": {k: v * 1e6 for k, v in self.comm_s.items()},
            "num_collectives": self.num_collectives,
        }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -np.inf
    for lo, hi in sorted(intervals):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def _breakdown(timeline: Timeline) -> tuple[float, float, float, dict[str, float], int]:
    world = timeline.world_size
    busy = np.zeros(world)
    comm: dict[str, list[tuple[float, float]]] = {}
    for task, start, end in zip(timeline.tasks, timeline.starts_s, timeline.ends_s, strict=True):
        if task.compute_s is not None:
            busy += task.compute_s
        else:
            comm.setdefault(task.category, []).append((float(start), float(end)))
    step = timeline.step_s
    slowest = int(np.argmax(busy))
    compute = float(
        sum(
            t.compute_s[slowest]
            for t in timeline.tasks
            if t.compute_s is not None and t.category == "compute"
        )
    )
    exposed = max(0.0, step - float(busy[slowest]))
    in_flight = {k: _union(v) for k, v in comm.items()}
    total = _union([iv for v in comm.values() for iv in v])
    return (
        compute,
        exposed,
        max(0.0, total - exposed),
        in_flight,
        sum(len(v) for v in comm.values()),
    )


def simulate_step(
    cluster: ClusterModel, workload: ModelProfile, plan: CommPlan | None = None
) -> StepResult:
    """Predict the step time of ``workload`` on ``cluster`` with ``plan`` (torch DDP's by default).

    Args:
        cluster: the cluster model (``PRESETS["dgx-h100"]``, ``load_cluster(path)``, or one
            calibrated by ``commfuse simulate --validate``).
        workload: the per-layer model (``transformer(...)``, ``dlrm(...)``, ``from_module(...)``).
        plan: how its communication is carried out (``commfuse.train.sim_plan.plan_for`` makes
            one from a training strategy config); None: torch DDP's defaults.

    Returns:
        The predicted step and its breakdown (compute, exposed and overlapped communication) for
        the slowest rank; with local SGD, the mean step over one period.

    Raises:
        ValueError: a workload that does not fit the cluster's memory, or a plan the cluster
            cannot run (the message says what to change).

    Example:
        ```python
        plan = plan_for(CommfuseDPConfig(compressor=PowerSGD(rank=4)))
        result = simulate_step(PRESETS["dgx-h100"].with_ranks(1024), transformer(), plan)
        print(result.step_s, result.exposed_comm_s)
        ```
    """
    plan = plan or CommPlan()
    cpu = cluster.comm_cpu_us_per_mbyte
    synced = simulate_shared_cpu(
        build_step(cluster, workload, plan, sync=True), cluster.world_size, cpu
    )
    compute, exposed, overlapped, in_flight, count = _breakdown(synced)
    step = synced.step_s
    period = plan.local_sgd_period
    if period > 1:
        local = simulate_shared_cpu(
            build_step(cluster, workload, plan, sync=False), cluster.world_size, cpu
        )
        lc, le, lo, _, _ = _breakdown(local)
        step = (local.step_s * (period - 1) + step) / period
        exposed = (le * (period - 1) + exposed) / period
        overlapped = (lo * (period - 1) + overlapped) / period
        compute = (lc * (period - 1) + compute) / period
    return StepResult(
        step_s=step,
        compute_s=compute,
        exposed_comm_s=exposed,
        overlapped_comm_s=overlapped,
        comm_s=in_flight,
        num_collectives=count,
        timeline=synced,
    )


def chrome_trace(timeline: Timeline, path: str | Path, *, ranks: list[int] | None = None) -> int:
    """Write the timeline of ``ranks`` (rank 0 by default) as a Chrome trace (chrome://tracing,
    ui.perfetto.dev): one process per rank, one thread per stream. Returns the event count."""
    ranks = ranks or [0]
    events: list[dict[str, Any]] = []
    tids = {"compute": 0, "mp": 1, "dp": 2}
    for rank in ranks:
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for stream, tid in tids.items():
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": stream},
                }
            )
        for task, start, end in zip(
            timeline.tasks, timeline.starts_s, timeline.ends_s, strict=True
        ):
            lo = float(start[rank]) if isinstance(start, np.ndarray) else float(start)
            hi = float(end[rank]) if isinstance(end, np.ndarray) else float(end)
            if hi <= lo and task.category == "delay":
                continue
            args: dict[str, Any] = {"category": task.category}
            if task.nbytes:
                args["bytes"] = task.nbytes
            events.append(
                {
                    "ph": "X",
                    "name": task.name,
                    "cat": task.category,
                    "pid": rank,
                    "tid": tids[task.stream],
                    "ts": lo * 1e6,
                    "dur": (hi - lo) * 1e6,
                    "args": args,
                }
            )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)

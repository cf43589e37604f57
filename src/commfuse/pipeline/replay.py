"""Replay a schedule on the alpha-beta link model: the step time and the bubble.

Each rank runs its compute actions in its order; an action starts when the rank is free and the
results it needs (``Schedule.dependencies``) are there. A result made on another rank arrives
``alpha + n * beta`` after its action ends (Hockney's model, ``collectives/cost.py``), ``n`` the
bytes of the activation or gradient it carries; on the same rank it is there at once. Sends do
not queue behind each other on a link, and a rank computes while its messages travel (gloo moves
them on its own threads).

The bubble is the idle share of the ranks' time over the step:
``1 - sum(busy) / (ranks * step)``. For 1F1B with equal stages and free links it is
``(p - 1) / (m + p - 1)`` (Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", SC 2021), the same as GPipe's (Huang et al., NeurIPS 2019); the
interleaved schedule with ``v`` stages per rank divides the bubble time by ``v``; ZB-H1 shrinks
it to ``(p - 1)(F + I - W)`` (Qi et al., ICLR 2024).

``bubble_of_events`` measures the same fraction on a Chrome trace: the replay's, or a run's
(the runtime's compute actions in the communicator's trace, ``runtime.py``).

A replay that cannot finish is a deadlock of the schedule itself: ``ScheduleError`` names each
rank's waiting action and what it waits for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from commfuse.collectives.cost import LinkCost
from commfuse.pipeline.actions import Action
from commfuse.pipeline.schedule import Schedule, ScheduleError


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageTimes:
    """Seconds of each kind of compute action, the same on every stage."""

    forward_s: float = 1.0
    """One micro-batch's forward through one stage."""
    backward_input_s: float = 1.0
    """The input-gradient half of its backward (``I``)."""
    backward_weight_s: float = 1.0
    """The weight-gradient half (``W``); a full backward (``B``) costs both halves."""

    def of(self, action: Action) -> float:
        return {
            "F": self.forward_s,
            "I": self.backward_input_s,
            "W": self.backward_weight_s,
            "B": self.backward_input_s + self.backward_weight_s,
        }[action.kind]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """When each compute action ran in the replay, and what that makes of the step."""

    step_s: float
    """From the first action's start to the last one's end."""
    busy_s: tuple[float, ...]
    """Per rank, the seconds it computed."""
    start_s: dict[Action, float]
    """Each compute action's start."""
    finish_s: dict[Action, float]
    """Each compute action's end."""

    def chrome_events(self, schedule: Schedule) -> list[dict[str, Any]]:
        """Each compute action as a Chrome trace event (seconds of the model shown as
        microseconds), one process per rank: ``comm.trace.write_chrome_trace`` writes them."""
        return [
            {
                "name": str(a),
                "cat": "pipeline",
                "ph": "X",
                "ts": start * 1e6,
                "dur": (self.finish_s[a] - start) * 1e6,
                "pid": schedule.stage_to_rank[a.stage],
                "tid": "compute",
                "args": {"stage": a.stage, "microbatch": a.microbatch},
            }
            for a, start in sorted(self.start_s.items(), key=lambda item: item[1])
        ]

    @property
    def bubble_fraction(self) -> float:
        """The idle share of all ranks' time, ``1 - sum(busy) / (ranks * step)``."""
        if self.step_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s)


def replay(
    schedule: Schedule,
    *,
    times: StageTimes | Callable[[Action], float] | None = None,
    link: LinkCost | None = None,
    boundary_bytes: int | Callable[[Action], int] = 0,
) -> ReplayResult:
    """Run ``schedule`` on the model of the module docstring.

    Args:
        schedule: compute-only or lowered (its sends and receives are not priced twice: a
            message costs the link once, between its producer and its consumer).
        times: seconds per compute action; None: one unit each for F, I and W (B = I + W).
        link: the link between ranks; None: free (messages arrive at once).
        boundary_bytes: bytes of the result an action sends to the next rank (an activation
            after ``F``, a gradient after ``B``/``I``): a number, or a function of the action.

    Returns:
        Each action's start and end, the step time and the bubble.

    Raises:
        ScheduleError: the schedule deadlocks (the message names each waiting rank).

    Example:
        ```python
        r = replay(one_f_one_b(num_stages=4, num_microbatches=8))
        assert abs(r.bubble_fraction - 3 / 11) < 1e-12
        ```
    """
    cost = times.of if isinstance(times, StageTimes) else times or StageTimes().of
    size = boundary_bytes if callable(boundary_bytes) else (lambda _a: boundary_bytes)

    def arrival(dep: Action, rank: int, finish: float) -> float:
        if link is None or schedule.stage_to_rank[dep.stage] == rank:
            return finish
        return finish + link.alpha_s + size(dep) * link.beta_s_per_byte

    rows = [schedule.compute_actions(r) for r in range(schedule.num_ranks)]
    at = [0] * len(rows)
    free = [0.0] * len(rows)
    busy = [0.0] * len(rows)
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    while any(at[r] < len(rows[r]) for r in range(len(rows))):
        progressed = False
        for r, row in enumerate(rows):
            while at[r] < len(row):
                action = row[at[r]]
                deps = schedule.dependencies(action)
                if any(d not in finish for d in deps):
                    break
                begin = max([free[r], *(arrival(d, r, finish[d]) for d in deps)])
                length = cost(action)
                start[action], finish[action] = begin, begin + length
                free[r] = begin + length
                busy[r] += length
                at[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock(schedule, rows, at, finish))
    first = min(start.values(), default=0.0)
    last = max(finish.values(), default=0.0)
    return ReplayResult(step_s=last - first, busy_s=tuple(busy), start_s=start, finish_s=finish)


def _deadlock(
    schedule: Schedule, rows: list[list[Action]], at: list[int], finish: dict[Action, float]
) -> str:
    waits = []
    for r, row in enumerate(rows):
        if at[r] < len(row):
            action = row[at[r]]
            missing = [d for d in schedule.dependencies(action) if d not in finish]
            names = ", ".join(
                f"{d} (rank {schedule.stage_to_rank[d.stage]})"
                if d.stage < schedule.num_stages
                else f"{d} (no such stage)"
                for d in missing
            )
            waits.append(f"rank {r} waits at {action} (its action {at[r]}) for {names}")
    return f"schedule {schedule.name!r} cannot finish (deadlock): " + "; ".join(waits)


def on_grid(schedule: Schedule) -> Schedule:
    """``schedule``'s compute actions, each at the step it could start at with one unit per
    action and free links, None where its rank waits: the grid of an order (a generator's, or
    torch's single-stage schedules, which drop idle steps); a grid comes back unchanged.

    Raises:
        ScheduleError: the orders deadlock.
    """
    if schedule.grid:
        return schedule
    timed = replay(schedule, times=lambda _a: 1.0)
    rows: list[tuple[Action | None, ...]] = []
    for rank in range(schedule.num_ranks):
        order = schedule.compute_actions(rank)
        steps = [math.floor(timed.start_s[a]) for a in order]
        row: list[Action | None] = [None] * (max(steps, default=-1) + 1)
        for a, t in zip(order, steps, strict=True):
            row[t] = a
        rows.append(tuple(row))
    return dataclasses.replace(schedule, actions=tuple(rows), grid=True)


def bubble_of_events(events: Sequence[Mapping[str, Any]]) -> float:
    """The bubble of a timeline: ``1 - sum(busy) / (ranks * span)`` over the Chrome trace
    events that are compute actions (named ``0F1`` as the replay names them, or
    ``pipeline 0F1`` as the runtime does in the communicator's trace), ``pid`` the rank.

    Raises:
        ValueError: no compute action among the events.
    """
    busy: dict[int, float] = {}
    first, last = float("inf"), float("-inf")
    for e in events:
        name = str(e.get("name", "")).removeprefix("pipeline ")
        try:
            if e.get("ph") != "X" or not Action.parse(name).is_compute:
                continue
        except ValueError:
            continue
        start, length = float(e["ts"]), float(e["dur"])
        busy[int(e["pid"])] = busy.get(int(e["pid"]), 0.0) + length
        first, last = min(first, start), max(last, start + length)
    if not busy:
        raise ValueError("no compute action (0F1, pipeline 0F1, ...) among the trace's events")
    span = last - first
    return 0.0 if span <= 0 else 1.0 - sum(busy.values()) / (len(busy) * span)

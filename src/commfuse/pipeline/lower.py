"""The lowering: a compute-only schedule plus the sends and receives its ranks exchange.

torch's pipelining lowers its schedules the same way (``_add_send_recv``): each result that
crosses ranks becomes a ``SEND`` on the rank that made it, right after the action, and a
``RECV`` on the rank that uses it. Here the receive goes as early as the grid allows: at the
step where the sender computes, so the runtime posts it while the data is on its way and the
transfer of micro-batch ``m`` overlaps the compute of ``m + 1``.

1. Walk the grid step by step; at each step, each rank's action, then its send if its result
   leaves the rank (``SEND_F`` after ``F`` unless the next stage is local, ``SEND_B`` after ``B``
   or ``I`` unless the previous stage is).
2. After the step, the receiving rank gets the matching ``RECV_F`` (for stage ``s + 1``) or
   ``RECV_B`` (for stage ``s - 1``), in the order of the sending ranks.
3. Idle steps are dropped: a lowered schedule is an order, not a grid.

An order without steps (torch's single-stage schedules drop their idle steps) is first placed
on its grid (``replay.on_grid``).

The grid's stages-in-order rule (``validate``, check 4) puts every receive before its use.
"""

from __future__ import annotations

import dataclasses

from commfuse.pipeline.actions import Action
from commfuse.pipeline.replay import on_grid
from commfuse.pipeline.schedule import Schedule, ScheduleError
from commfuse.pipeline.validate import message_of, validate


def lower(schedule: Schedule) -> Schedule:
    """``schedule`` with its sends and receives (module docstring).

    Args:
        schedule: a compute-only schedule: a grid (a generator's) or an order (one read from
            torch's CSV), which is first placed on its grid (``replay.on_grid``); torch's
            memory actions (``REDUCE_GRAD``) are dropped.

    Returns:
        The lowered schedule, validated.

    Raises:
        ScheduleError: ``schedule`` is already lowered or fails ``validate``.

    Example:
        ```python
        lowered = lower(one_f_one_b(num_stages=2, num_microbatches=2))
        print([str(a) for a in lowered.actions[1]])  # ['1RECV_F0', '1F0', '1B0', '1SEND_B0', ...]
        ```
    """
    if schedule.is_lowered:
        raise ScheduleError(f"schedule {schedule.name!r} is lowered already")
    validate(schedule)
    schedule = on_grid(schedule)
    rows: list[list[Action]] = [[] for _ in range(schedule.num_ranks)]
    steps = max((len(row) for row in schedule.actions), default=0)
    for t in range(steps):
        arriving: list[tuple[int, Action]] = []
        for rank, row in enumerate(schedule.actions):
            a = row[t] if t < len(row) else None
            if a is None:
                continue
            rows[rank].append(a)
            pair = message_of(schedule, a) if a.is_compute else None
            if pair is not None:
                rows[rank].append(pair[0])
                arriving.append((schedule.stage_to_rank[pair[1].stage], pair[1]))
        for to, recv in arriving:
            rows[to].append(recv)
    lowered = dataclasses.replace(schedule, actions=tuple(tuple(r) for r in rows), grid=False)
    validate(lowered)
    return lowered

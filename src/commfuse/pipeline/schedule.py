"""A pipeline schedule: which rank runs which action at which step, and what each action needs.

The model is cut into ``num_stages`` consecutive stages; stage ``s`` lives on rank
``stage_to_rank[s]`` (one stage per rank, or several, as in the interleaved schedule); a batch is
split into ``num_microbatches`` micro-batches. The schedule is plain data: per rank, one action
(``actions.py``) or None per step. Every pass reads it the same way:

1. ``validate`` checks it (each micro-batch's forward before its backward, stages in order);
2. ``lower`` adds the sends and receives between ranks;
3. ``replay`` prices it on the alpha-beta link model;
4. ``PipelineRuntime`` executes it.

An action needs the results of others (``dependencies``), which is all the passes use:

* ``sF m`` needs ``(s-1)F m``, the previous stage's output (its activation);
* ``sB m`` and ``sI m`` need ``sF m`` and the next stage's ``B`` or ``I`` of ``m`` (the gradient
  of its output); the last stage starts the backward from its own loss;
* ``sW m`` needs ``sI m``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

from commfuse.pipeline.actions import (
    COMM_KINDS,
    Action,
    RankActions,
    format_rows,
    read_csv,
    write_csv,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per rank, one action or None (idle) per step; see the module docstring.

    Example:
        ```python
        s = one_f_one_b(num_stages=4, num_microbatches=8)
        print(s)                      # the grid, one column per rank
        s.to_csv("1f1b.csv")          # torch's _load_csv reads it
        ```
    """

    name: str
    """What generated it (``"1f1b"``, ``"gpipe"``, or ``"custom"``)."""
    num_stages: int
    """Stages the model is cut into."""
    num_microbatches: int
    """Micro-batches per step."""
    stage_to_rank: tuple[int, ...]
    """The rank that holds each stage."""
    actions: tuple[RankActions, ...]
    """Per rank, its actions in order (None: idle for a step)."""
    grid: bool = True
    """Whether a list's index is the time step, the same on every rank (the generators' grids);
    False: each list is only an order (a lowered schedule; torch's single-stage schedules,
    which drop their idle steps)."""

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def is_lowered(self) -> bool:
        """Whether the sends and receives are in (``lower``)."""
        return any(a is not None and a.kind in COMM_KINDS for row in self.actions for a in row)

    def compute_actions(self, rank: int) -> list[Action]:
        """The rank's compute actions in order (idle steps and communication left out)."""
        return [a for a in self.actions[rank] if a is not None and a.is_compute]

    @functools.cached_property
    def backward_of(self) -> dict[tuple[int, int], Action]:
        """The action that starts each (stage, micro-batch)'s backward: its ``B`` or its ``I``."""
        found: dict[tuple[int, int], Action] = {}
        for row in self.actions:
            for a in row:
                if a is not None and a.kind in ("B", "I") and a.microbatch is not None:
                    found[(a.stage, a.microbatch)] = a
        return found

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The compute actions whose results ``action`` needs (the module docstring's list)."""
        s, m = action.stage, action.microbatch
        assert m is not None, action
        if action.kind == "F":
            return (Action(s - 1, "F", m),) if s > 0 else ()
        if action.kind == "W":
            return (Action(s, "I", m),)
        if action.kind in ("B", "I"):
            own = Action(s, "F", m)
            if s == self.num_stages - 1:
                return (own,)
            after = self.backward_of.get((s + 1, m), Action(s + 1, "B", m))
            return (own, after)
        return ()

    def to_csv(self, path: str | Path) -> None:
        """Write the schedule in torch's CSV format (``actions.py``)."""
        write_csv(self.actions, path)

    def __str__(self) -> str:
        rows = format_rows(self.actions)
        steps = max((len(r) for r in rows), default=0)
        width = max([6, *(len(c) for r in rows for c in r)])
        lines = ["step  " + " ".join(f"{'rank ' + str(r):>{width}}" for r in range(len(rows)))]
        for t in range(steps):
            cells = [r[t] if t < len(r) else "" for r in rows]
            lines.append(f"{t:>4}  " + " ".join(f"{c:>{width}}" for c in cells))
        return "\n".join(lines)


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the rank, the step and the action."""


def schedule_from_actions(
    actions: Sequence[Sequence[Action | None]],
    *,
    name: str = "custom",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    grid: bool = False,
) -> Schedule:
    """A schedule from per-rank actions (a CSV's rows, a hand-written list), with the stages, the
    micro-batch count and each stage's rank read off the actions unless given.

    Args:
        actions: per rank, its actions (None: idle).
        name: a label for errors and reports.
        num_stages: the stage count; None: one more than the largest stage index seen.
        num_microbatches: the micro-batch count; None: one more than the largest index seen.
        grid: whether the lists' indices are time steps (``Schedule.grid``); the validator then
            checks that stages run in order step by step.

    Returns:
        The schedule (not yet validated: call ``validate``).

    Raises:
        ValueError: a stage's compute actions sit on two ranks, or a stage has none.

    Example:
        ```python
        s = schedule_from_actions([[Action.parse("0F0"), None, Action.parse("0B0")], ...])
        ```
    """
    rows = tuple(tuple(row) for row in actions)
    seen = [a for row in rows for a in row if a is not None]
    stages = num_stages if num_stages is not None else max((a.stage for a in seen), default=-1) + 1
    mbs = [a.microbatch for a in seen if a.microbatch is not None]
    count = num_microbatches if num_microbatches is not None else max(mbs, default=-1) + 1
    owner: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for a in row:
            if a is None or not a.is_compute:
                continue
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"schedule {name!r}: stage {a.stage} computes on rank {owner[a.stage]} and on "
                    f"rank {rank} ({a}); a stage lives on one rank"
                )
    missing = [s for s in range(stages) if s not in owner]
    if missing:
        raise ValueError(
            f"schedule {name!r}: stage(s) {missing} have no compute action on any rank"
        )
    return Schedule(
        name=name,
        num_stages=stages,
        num_microbatches=count,
        stage_to_rank=tuple(owner[s] for s in range(stages)),
        actions=rows,
        grid=grid,
    )


def schedule_from_csv(path: str | Path, *, name: str | None = None, grid: bool = False) -> Schedule:
    """A schedule from a CSV file in torch's format (``actions.py``), compute-only or lowered;
    ``grid``: its columns are time steps (as ``Schedule.to_csv`` writes a generator's).

    Raises:
        ValueError: a cell that is not an action, or what ``schedule_from_actions`` raises.
    """
    return schedule_from_actions(read_csv(path), name=name or Path(path).stem, grid=grid)

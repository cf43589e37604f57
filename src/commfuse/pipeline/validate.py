"""The validator: a schedule that passes runs, and one that fails says where and why.

Checks, in order, each failure a ``ScheduleError`` naming rank, step and action:

1. every action names a stage and micro-batch that exist, on the rank that holds the stage;
2. each (stage, micro-batch) has exactly one ``F`` and one backward, a ``B`` or an ``I`` and a
   ``W`` (never both forms);
3. on its rank, a micro-batch's ``F`` comes before its ``B`` or ``I``, and ``I`` before ``W``;
4. stages in order: a grid (``Schedule.grid``) holds one action per rank per step, so an
   action that needs another rank's result (``Schedule.dependencies``) must sit at a later
   step than the action making it;
5. the ranks' orders do not deadlock (``replay``);
6. in a lowered schedule, every result crossing ranks has one send after the action making it
   and one receive before the action using it, and nothing else is sent.

torch's ``_validate_schedule`` checks 2 and 3; 4 to 6 are what make a schedule safe to hand to
``PipelineRuntime``, whose receives would otherwise wait out their deadline.
"""

from __future__ import annotations

from collections import Counter

from commfuse.pipeline.actions import MEMORY_KINDS, Action
from commfuse.pipeline.replay import replay
from commfuse.pipeline.schedule import Schedule, ScheduleError


def validate(schedule: Schedule) -> None:
    """Check ``schedule`` (module docstring); return quietly when it is sound.

    Args:
        schedule: compute-only or lowered.

    Raises:
        ScheduleError: the first problem found, naming rank, step and action.

    Example:
        ```python
        validate(one_f_one_b(num_stages=4, num_microbatches=8))
        validate(lower(zb_h1(num_stages=4, num_microbatches=8)))
        ```
    """
    _check_placement(schedule)
    _check_counts(schedule)
    _check_rank_order(schedule)
    if schedule.grid and not schedule.is_lowered:
        _check_steps(schedule)
    replay(schedule, times=lambda _a: 1.0)
    if schedule.is_lowered:
        _check_messages(schedule)


def _where(schedule: Schedule, rank: int, step: int, action: Action) -> str:
    return f"schedule {schedule.name!r}, rank {rank}, step {step}, {action}"


def _check_placement(schedule: Schedule) -> None:
    if len(schedule.stage_to_rank) != schedule.num_stages:
        raise ScheduleError(
            f"schedule {schedule.name!r}: stage_to_rank has {len(schedule.stage_to_rank)} "
            f"entries for {schedule.num_stages} stages"
        )
    bad = [r for r in schedule.stage_to_rank if not 0 <= r < schedule.num_ranks]
    if bad:
        raise ScheduleError(
            f"schedule {schedule.name!r}: stage_to_rank names rank(s) {bad}, but the schedule "
            f"has {schedule.num_ranks} ranks"
        )
    for rank, row in enumerate(schedule.actions):
        for step, a in enumerate(row):
            if a is None:
                continue
            where = _where(schedule, rank, step, a)
            if not 0 <= a.stage < schedule.num_stages:
                raise ScheduleError(
                    f"{where}: no stage {a.stage} (stages 0..{schedule.num_stages - 1})"
                )
            if a.kind in MEMORY_KINDS:
                continue
            if a.microbatch is None or not 0 <= a.microbatch < schedule.num_microbatches:
                raise ScheduleError(
                    f"{where}: no micro-batch {a.microbatch} (0..{schedule.num_microbatches - 1})"
                )
            if schedule.stage_to_rank[a.stage] != rank:
                raise ScheduleError(
                    f"{where}: stage {a.stage} lives on rank {schedule.stage_to_rank[a.stage]}"
                )


def _check_counts(schedule: Schedule) -> None:
    counts = Counter(a for row in schedule.actions for a in row if a is not None and a.is_compute)
    twice = sorted((str(a) for a, n in counts.items() if n > 1))
    if twice:
        raise ScheduleError(f"schedule {schedule.name!r}: actions run more than once: {twice}")
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            has = {k for k in "FBIW" if Action(s, k, m) in counts}  # type: ignore[arg-type]
            name = f"schedule {schedule.name!r}, stage {s}, micro-batch {m}"
            if "F" not in has:
                raise ScheduleError(f"{name}: no forward ({s}F{m})")
            if "B" in has and has & {"I", "W"}:
                raise ScheduleError(f"{name}: both a full backward and a split one (B with I/W)")
            if "B" not in has and has != {"F", "I", "W"}:
                lacks = sorted({"I", "W"} - has) if has & {"I", "W"} else ["B (or I and W)"]
                raise ScheduleError(f"{name}: no {' and no '.join(lacks)}")


def _check_rank_order(schedule: Schedule) -> None:
    before = {"B": "F", "I": "F", "W": "I"}
    for rank, row in enumerate(schedule.actions):
        done: set[Action] = set()
        for step, a in enumerate(row):
            if a is None or not a.is_compute:
                continue
            if a.kind in before:
                need = Action(a.stage, before[a.kind], a.microbatch)  # type: ignore[arg-type]
                if need not in done:
                    raise ScheduleError(
                        f"{_where(schedule, rank, step, a)}: runs before {need}, which it needs"
                    )
            done.add(a)


def _check_steps(schedule: Schedule) -> None:
    step_of = {
        a: (rank, step)
        for rank, row in enumerate(schedule.actions)
        for step, a in enumerate(row)
        if a is not None and a.is_compute
    }
    for a, (rank, step) in step_of.items():
        for dep in schedule.dependencies(a):
            dep_rank, dep_step = step_of[dep]
            if dep_rank != rank and dep_step >= step:
                raise ScheduleError(
                    f"{_where(schedule, rank, step, a)}: needs {dep}, which rank {dep_rank} runs "
                    f"at step {dep_step}, not before (stages out of order)"
                )


def message_of(schedule: Schedule, a: Action) -> tuple[Action, Action] | None:
    """The (send, receive) pair that carries ``a``'s result to another rank, if it does."""
    s, m, ranks = a.stage, a.microbatch, schedule.stage_to_rank
    if a.kind == "F" and s + 1 < schedule.num_stages and ranks[s + 1] != ranks[s]:
        return Action(s, "SEND_F", m), Action(s + 1, "RECV_F", m)
    if a.kind in ("B", "I") and s > 0 and ranks[s - 1] != ranks[s]:
        return Action(s, "SEND_B", m), Action(s - 1, "RECV_B", m)
    return None


def _check_messages(schedule: Schedule) -> None:
    position = {
        a: (rank, step)
        for rank, row in enumerate(schedule.actions)
        for step, a in enumerate(row)
        if a is not None
    }
    expected: set[Action] = set()
    for a, (rank, step) in position.items():
        pair = message_of(schedule, a) if a.is_compute else None
        if pair is None:
            continue
        send, recv = pair
        expected |= {send, recv}
        if send not in position or position[send][1] < step:
            raise ScheduleError(f"{_where(schedule, rank, step, a)}: no {send} after it")
        user = Action(recv.stage, "F", a.microbatch) if a.kind == "F" else None
        user = user or schedule.backward_of[(recv.stage, a.microbatch)]  # type: ignore[index]
        if recv not in position or position[recv][1] > position[user][1]:
            raise ScheduleError(f"{_where(schedule, *position[user], user)}: no {recv} before it")
    comm = Counter(
        a
        for row in schedule.actions
        for a in row
        if a is not None and a.kind.startswith(("SEND", "RECV"))
    )
    extra = sorted(str(a) for a, n in comm.items() if a not in expected or n > 1)
    if extra:
        raise ScheduleError(f"schedule {schedule.name!r}: sends/receives with no match: {extra}")

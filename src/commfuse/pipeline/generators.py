"""The schedules: GPipe, 1F1B, interleaved 1F1B and ZB-H1, each as its ranks' action orders.

``sequential`` (no pipelining: one micro-batch at a time through every stage, bubble
``(p - 1) / p``) is the reference the others are measured against.

A generator writes down only each rank's order of compute actions; ``replay.on_grid`` places
them on steps by replaying the orders with one time unit per action and free links, so that a rank idles
(None) exactly where it would wait. ``p`` is the number of ranks, ``m`` of micro-batches.

1. GPipe (Huang et al., "GPipe", NeurIPS 2019): all forwards, then all backwards. Bubble
   ``(p - 1) / (m + p - 1)``; it holds ``m`` micro-batches' activations.
2. 1F1B (Narayanan et al., "PipeDream", SOSP 2019; the flush variant of "Memory-Efficient
   Pipeline-Parallel DNN Training", ICML 2021): rank ``r`` runs ``p - 1 - r`` forwards, then
   alternates one forward and one backward, then drains. Same bubble as GPipe, but at most
   ``p - r`` micro-batches in flight.
3. Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
   Clusters Using Megatron-LM", SC 2021): ``v`` stages per rank, stage ``s`` on rank ``s % p``;
   forwards go round by round (``k`` micro-batches through chunk 0, then chunk 1, ...), after
   ``2 (p - 1 - r) + (v - 1) k`` warm-up forwards, ``k = m / max(1, m // p)`` (``p`` when
   ``m`` is a multiple of it; torch's relaxed rounds otherwise). Bubble time divided by ``v``,
   ``v`` times the messages.
4. ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward
   split into ``I`` (input gradient, on the critical path) and ``W`` (weight gradient, which
   nothing waits for); rank ``r`` defers its first ``r`` ``W``s into the drain's bubbles. With
   ``F = I = W`` the bubble falls from ``3 (p - 1)`` to ``p - 1`` units at 1F1B's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from commfuse.pipeline.actions import Action, ActionKind
from commfuse.pipeline.replay import on_grid
from commfuse.pipeline.schedule import Schedule

SCHEDULES = ("sequential", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
"""The names ``schedule_by_name`` knows."""


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a pipeline needs at least 1 stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: a step needs at least 1")


def _on_grid(
    name: str,
    orders: Sequence[Sequence[Action]],
    stage_to_rank: Sequence[int],
    num_microbatches: int,
) -> Schedule:
    loose = Schedule(
        name=name,
        num_stages=len(stage_to_rank),
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(tuple(order) for order in orders),
        grid=False,
    )
    return on_grid(loose)


def sequential(*, num_stages: int, num_microbatches: int) -> Schedule:
    """No pipelining: each micro-batch's forward and backward through every stage before the
    next one starts (each rank runs ``F m, B m`` in turn), the reference a pipelined step is
    compared with. Bubble ``(p - 1) / p``.

    Raises:
        ValueError: fewer than one stage or micro-batch.
    """
    _check(num_stages, num_microbatches)
    orders = [
        [Action(s, k, i) for i in range(num_microbatches) for k in ("F", "B")]
        for s in range(num_stages)
    ]
    return _on_grid("sequential", orders, range(num_stages), num_microbatches)


def gpipe(*, num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward (module docstring, item 1).

    Raises:
        ValueError: fewer than one stage or micro-batch.
    """
    _check(num_stages, num_microbatches)
    m = range(num_microbatches)
    orders = [
        [Action(s, "F", i) for i in m] + [Action(s, "B", i) for i in m] for s in range(num_stages)
    ]
    return _on_grid("gpipe", orders, range(num_stages), num_microbatches)


def _one_f_one_b_order(
    stage: int, num_stages: int, num_microbatches: int, split: bool
) -> list[Action]:
    """Rank ``stage``'s order in 1F1B (``split``: ZB-H1's, with ``I`` and deferred ``W``)."""
    warmup = min(num_stages - 1 - stage, num_microbatches)
    order = [Action(stage, "F", i) for i in range(warmup)]
    backward: ActionKind = "I" if split else "B"
    deferred = 0  # backwards done whose W is still to do
    weights_done = 0
    for i in range(num_microbatches):  # the i-th backward, after the forward it pairs with
        if warmup + i < num_microbatches:
            order.append(Action(stage, "F", warmup + i))
        order.append(Action(stage, backward, i))
        if split:
            deferred += 1
            if i >= stage:  # rank r keeps its first r weight gradients for the drain
                order.append(Action(stage, "W", weights_done))
                weights_done += 1
                deferred -= 1
    order += [Action(stage, "W", weights_done + k) for k in range(deferred)]
    return order


def one_f_one_b(*, num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with a flush (module docstring, item 2).

    Args:
        num_stages: stages, one per rank.
        num_microbatches: micro-batches per step (any count, fewer than stages too).

    Returns:
        The schedule on its grid.

    Raises:
        ValueError: fewer than one stage or micro-batch.

    Example:
        ```python
        print(one_f_one_b(num_stages=4, num_microbatches=8))
        ```
    """
    _check(num_stages, num_microbatches)
    orders = [_one_f_one_b_order(s, num_stages, num_microbatches, False) for s in range(num_stages)]
    return _on_grid("1f1b", orders, range(num_stages), num_microbatches)


def zb_h1(*, num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split into ``I`` and ``W`` (module docstring, item 4).

    Raises:
        ValueError: fewer than one stage or micro-batch.
    """
    _check(num_stages, num_microbatches)
    orders = [_one_f_one_b_order(s, num_stages, num_microbatches, True) for s in range(num_stages)]
    return _on_grid("zb_h1", orders, range(num_stages), num_microbatches)


def _rounds(per_round: int, num_microbatches: int, chunks: Sequence[int]) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in interleaved order: ``per_round`` micro-batches per round, each
    round through every chunk of ``chunks`` in turn."""
    out = []
    for first in range(0, num_microbatches, per_round):
        group = range(first, min(first + per_round, num_microbatches))
        out += [(c, i) for c in chunks for i in group]
    return out


def interleaved_1f1b(*, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B (module docstring, item 3): stage ``s`` on rank ``s % num_ranks``.

    Raises:
        ValueError: fewer than one rank, stage per rank or micro-batch, or a micro-batch count
            that does not split into rounds of equal size (``m % max(1, m // p) != 0``, as
            torch's ``ScheduleInterleaved1F1B`` asks).
    """
    p, v, m = num_ranks, stages_per_rank, num_microbatches
    _check(p * v, m)
    if p < 1 or v < 1:
        raise ValueError(f"num_ranks={p}, stages_per_rank={v}: both must be at least 1")
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"interleaved 1F1B runs the micro-batches in rounds of equal size: "
            f"num_microbatches={m} is not a multiple of its {rounds} rounds (m // num_ranks); "
            f"use a multiple of {p}, or fewer than {2 * p}"
        )
    k = m // rounds  # micro-batches per round
    orders = []
    for r in range(p):
        forwards = [Action(c * p + r, "F", i) for c, i in _rounds(k, m, range(v))]
        backwards = [Action(c * p + r, "B", i) for c, i in _rounds(k, m, range(v - 1, -1, -1))]
        warmup = min(2 * (p - 1 - r) + (v - 1) * k, len(forwards))
        order = forwards[:warmup]
        for j, b in enumerate(backwards):
            if warmup + j < len(forwards):
                order.append(forwards[warmup + j])
            order.append(b)
        orders.append(order)
    return _on_grid("interleaved_1f1b", orders, [s % p for s in range(p * v)], m)


def schedule_by_name(
    name: str, *, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
) -> Schedule:
    """The schedule ``name`` (one of ``SCHEDULES``) for ``num_ranks`` ranks.

    Raises:
        ValueError: an unknown name, ``stages_per_rank`` other than 1 for a schedule with one
            stage per rank, or what the generator raises.
    """
    if name == "interleaved_1f1b":
        return interleaved_1f1b(
            num_ranks=num_ranks, stages_per_rank=stages_per_rank, num_microbatches=num_microbatches
        )
    makers = {"sequential": sequential, "gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}
    if name not in makers:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if stages_per_rank != 1:
        raise ValueError(f"{name} runs one stage per rank; stages_per_rank={stages_per_rank}")
    return makers[name](num_stages=num_ranks, num_microbatches=num_microbatches)

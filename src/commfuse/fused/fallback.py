"""Choosing between a fused pipeline and the unfused operator when the two use different collectives.

The choice made here, in three steps:

1. Measure ``C`` (the computation alone), ``M_unfused`` (the collective the unfused path calls)
   and ``M_fused`` (the same bytes moved by the fused path's own transport, in one piece), and the
   per-chunk overhead ``o``; agree all four across ranks (max), since every rank must cut the
   same number of chunks.
2. Pick ``k`` in ``[2, max_chunks]`` minimising ``T_fused(k) = max(C, M_fused) + min(C, M_fused) / k
   + k o`` and keep it only if ``T_fused(k) <= (1 - min_gain) (C + M_unfused)``; else ``k = 1``,
   the unfused operator with the native collective.
3. Optionally (``trial``), confirm by timing: run the fused operator with ``k`` and the unfused one
   in ``trial_runs`` rounds, each round timing both back to back (the order alternating, so
   neither always runs first), and judge the per-round ratios fused / unfused (slowest rank):
   their median at most ``1 - min_gain`` means faster, at least 1 means not faster, anything
   between is unclear (``trial_verdict``). Faster keeps ``k``, not faster falls back to 1. On a
   loaded machine the model's inputs are noisy and the overlap itself can fail (two ranks'
   matmuls competing for one core), so a measured loss is the last word: fusion must never
   make an operator measurably slower than unfused. An unclear trial keeps ``k`` where the
   caller says so (``unclear_keeps``: the model predicted a gain of ``min_gain`` and the trial
   did not refute it), else falls back. Paired ratios see the load each round had, where two
   medians taken apart can differ by the load alone.

Design notes: ``docs/fused.md``, "Fused or unfused when the collectives differ".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from commfuse.comm import Communicator
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused.chunking import ChunkConfig, ChunkSchedule, predict_us


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """The inputs of the choice, in microseconds, agreed across ranks (max)."""

    compute_us: float
    """The computation alone (C)."""
    fused_comm_us: float
    """The collective as the fused path moves it, in one piece (M_fused)."""
    unfused_comm_us: float
    """The collective the unfused path calls (M_unfused)."""
    overhead_us: float
    """Per-chunk overhead o."""

    @property
    def unfused_us(self) -> float:
        """Predicted unfused time C + M_unfused."""
        return self.compute_us + self.unfused_comm_us

    def fused_us(self, chunks: int) -> float:
        """Predicted fused time with ``chunks`` pieces (``chunks=1`` is the unfused path)."""
        if chunks == 1:
            return self.unfused_us
        return predict_us(self.compute_us, self.fused_comm_us, chunks, self.overhead_us)


def choose_against_unfused(measured: Measured, *, max_chunks: int, min_gain: float) -> int:
    """Step 2 of the module docstring: the best ``k >= 2`` if it beats the unfused path by
    ``min_gain``, else 1."""
    if max_chunks < 2 or min(measured.compute_us, measured.fused_comm_us) <= 0:
        return 1
    c, m, o = measured.compute_us, measured.fused_comm_us, measured.overhead_us
    root = math.sqrt(min(c, m) / o) if o > 0 else float(max_chunks)
    candidates = {max(2, min(max_chunks, k)) for k in (math.floor(root), math.ceil(root))}
    best = min(sorted(candidates), key=measured.fused_us)
    if measured.fused_us(best) > (1.0 - min_gain) * measured.unfused_us:
        return 1
    return best


def agree(comm: Communicator, times: list[float]) -> list[float]:
    """Each time's maximum over ranks (one tiny all-reduce)."""
    t = torch.tensor(times, dtype=torch.float64, device=comm.device)
    comm.all_reduce(t, "max")
    return [float(v) for v in t.tolist()]


def timed_us(comm: Communicator, fn: Callable[[], Any]) -> float:
    """Wall time of ``fn`` on this rank, started together (barrier) on every rank."""
    comm.barrier()
    start = now(comm.device)
    fn()
    return elapsed_us(start, comm.device)


Verdict = Literal["faster", "unclear", "not faster"]


def trial_verdict(
    unfused_us: Sequence[float], fused_us: Sequence[float], *, min_gain: float
) -> Verdict:
    """Step 3's judgement of paired rounds (round ``i`` timed ``unfused_us[i]`` and
    ``fused_us[i]``): the median of the ratios fused / unfused at most ``1 - min_gain`` is
    "faster", at least 1 "not faster", else "unclear"."""
    if len(unfused_us) != len(fused_us) or not fused_us:
        raise ValueError(
            f"need the same number (>= 1) of unfused and fused rounds, got "
            f"{len(unfused_us)} and {len(fused_us)}"
        )
    ratio = statistics.median(
        f / u if u > 0 else math.inf for u, f in zip(unfused_us, fused_us, strict=True)
    )
    if ratio <= 1.0 - min_gain:
        return "faster"
    return "not faster" if ratio >= 1.0 else "unclear"


def confirm_by_trial(
    comm: Communicator,
    chunks: int,
    fused: Callable[[int], Any],
    unfused: Callable[[], Any],
    *,
    runs: int,
    min_gain: float,
    unclear_keeps: bool = False,
) -> int:
    """Step 3: ``chunks`` if ``runs`` rounds of the fused operator against the unfused one
    (each round both, in alternating order) find it faster (``trial_verdict``), or unclear and
    ``unclear_keeps``; else 1. Every rank must call it alike."""
    if chunks == 1 or runs < 1 or comm.world_size == 1:
        return chunks
    u, f = round_times(comm, [unfused, lambda: fused(chunks)], runs=runs, alternate=True)
    verdict = trial_verdict(u, f, min_gain=min_gain)
    return chunks if verdict == "faster" or (verdict == "unclear" and unclear_keeps) else 1


def round_times(
    comm: Communicator, fns: Sequence[Callable[[], Any]], *, runs: int, alternate: bool
) -> list[list[float]]:
    """Each function's time in each of ``runs`` interleaved rounds (each run started together
    on every rank; its time the slowest rank's), in ``fns``'s order; ``alternate`` reverses the
    order within every other round. Every rank must call it alike."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(runs):
        order = list(enumerate(fns))
        for slot, fn in order[::-1] if alternate and i % 2 else order:
            times[slot].append(timed_us(comm, fn))
    agreed = agree(comm, [t for row in times for t in row])
    return [agreed[j * runs : (j + 1) * runs] for j in range(len(fns))]


def round_times_with_cpu(
    comm: Communicator, fns: Sequence[Callable[[], Any]], *, runs: int
) -> tuple[list[list[float]], list[list[float]]]:
    """``round_times`` with alternating order, and beside each wall time (slowest rank) the CPU
    time of the call, user + system of all threads, summed over ranks (``time.process_time``):
    (wall, cpu), each ``[len(fns)][runs]``. Every rank must call it alike."""
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for i in range(runs):
        order = list(enumerate(fns))
        for slot, fn in order[::-1] if i % 2 else order:
            start = time.process_time()
            wall[slot].append(timed_us(comm, fn))
            cpu[slot].append((time.process_time() - start) * 1e6)
    n = len(fns) * runs
    agreed = torch.tensor(
        [t for row in wall for t in row] + [t for row in cpu for t in row],
        dtype=torch.float64,
        device=comm.device,
    )
    slowest, total = agreed[:n].clone(), agreed[n:].clone()
    comm.all_reduce(slowest, "max")
    comm.all_reduce(total, "sum")
    w, c = slowest.tolist(), total.tolist()
    return (
        [w[j * runs : (j + 1) * runs] for j in range(len(fns))],
        [c[j * runs : (j + 1) * runs] for j in range(len(fns))],
    )


def paired_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """The median over rounds of ``other[i] / base[i]``."""
    return statistics.median(o / b if b > 0 else math.inf for b, o in zip(base, other, strict=True))


def pieces_that_pay(
    wall: dict[int, list[float]], cpu: dict[int, list[float]], *, min_gain: float
) -> int:
    """The rule of ``fewest_pieces_that_pay`` on measured rounds (``wall[k]``, ``cpu[k]`` per
    candidate ``k``, paired by round): start from the fewest pieces; a candidate with more
    replaces the kept one if its median wall ratio is at most ``1 - min_gain``, or below 1
    with a median CPU ratio at most 1."""
    ks = sorted(wall)
    best = ks[0]
    for k in ks[1:]:
        faster = paired_ratio(wall[best], wall[k])
        if faster <= 1.0 - min_gain or (faster < 1.0 and paired_ratio(cpu[best], cpu[k]) <= 1.0):
            best = k
    return best


def fewest_pieces_that_pay(
    comm: Communicator,
    candidates: Sequence[int],
    fused: Callable[[int], Any],
    unfused: Callable[[], Any],
    *,
    runs: int,
    min_gain: float,
    unclear_keeps: bool = False,
) -> int:
    """Step 3 with several chunked candidates (module docstring): time the unfused operator
    and ``fused(k)`` for each ``k`` in ``runs`` alternating rounds, wall and CPU; keep the
    fewest pieces that pay (``pieces_that_pay``), then judge it against the unfused operator
    as ``confirm_by_trial`` does (same rounds). Every rank must call it alike."""
    ks = sorted({k for k in candidates if k > 1})
    if not ks or runs < 1 or comm.world_size == 1:
        return ks[0] if ks else 1
    fns: list[Callable[[], Any]] = [unfused, *(functools.partial(fused, k) for k in ks)]
    wall, cpu = round_times_with_cpu(comm, fns, runs=runs)
    best = pieces_that_pay(
        dict(zip(ks, wall[1:], strict=True)), dict(zip(ks, cpu[1:], strict=True)), min_gain=min_gain
    )
    verdict = trial_verdict(wall[0], wall[1 + ks.index(best)], min_gain=min_gain)
    return best if verdict == "faster" or (verdict == "unclear" and unclear_keeps) else 1


def median_times(
    comm: Communicator, fns: Sequence[Callable[[], Any]], *, runs: int, alternate: bool
) -> list[float]:
    """Each function's median over ``round_times``'s rounds, in ``fns``'s order."""
    rounds = round_times(comm, fns, runs=runs, alternate=alternate)
    return [sorted(row)[runs // 2] for row in rounds]


def choose_fused_chunks(
    comm: Communicator,
    config: ChunkConfig,
    *,
    compute_us: float,
    fused_comm_us: float,
    unfused_comm_us: float,
    overhead_us: float,
    limit: int,
    trial: tuple[Callable[[int], Any], Callable[[], Any]] | None = None,
    trial_runs: int = 3,
    unclear_keeps: bool = False,
) -> int:
    """Steps 1-3: the number of chunks, the same on every rank. ``config.num_chunks`` overrides
    everything (capped at ``limit`` pieces); ``trial`` is ``(fused(k), unfused())`` to confirm
    a chunked choice by timing (``trial_runs`` rounds; ``unclear_keeps``: what an unclear
    trial decides, ``confirm_by_trial``)."""
    if config.num_chunks is not None:
        return max(1, min(config.num_chunks, max(limit, 1)))
    if config.overhead_us is not None:
        overhead_us = config.overhead_us
    c, mf, mu, o = agree(comm, [compute_us, fused_comm_us, unfused_comm_us, overhead_us])
    measured = Measured(compute_us=c, fused_comm_us=mf, unfused_comm_us=mu, overhead_us=o)
    chunks = choose_against_unfused(
        measured, max_chunks=min(config.max_chunks, max(limit, 1)), min_gain=config.min_gain
    )
    if trial is not None:
        chunks = confirm_by_trial(
            comm,
            chunks,
            trial[0],
            trial[1],
            runs=trial_runs,
            min_gain=config.min_gain,
            unclear_keeps=unclear_keeps,
        )
    return chunks


def fastest_by_trial(
    comm: Communicator,
    candidates: list[ChunkSchedule],
    run: Callable[[ChunkSchedule], Any],
    *,
    runs: int,
    min_gain: float,
) -> ChunkSchedule:
    """The candidate ``k`` whose median time (slowest rank, ``runs`` interleaved rounds) is the
    lowest, kept only if it beats ``k = 1`` (the unfused operator, always timed) by ``min_gain``;
    else 1. For operators whose chunk count changes the schedule in steps the model does not
    see (the embedding exchange cuts ``k`` into pieces per destination). Every rank must call it
    alike."""
    # By table first, then the counts upward (ties keep the earlier).
    ks: list[ChunkSchedule] = [
        1,
        *sorted({k for k in candidates if k != 1}, key=lambda k: k if isinstance(k, int) else 0),
    ]
    if len(ks) == 1 or runs < 1 or comm.world_size == 1:
        return 1
    fns = [functools.partial(run, k) for k in ks]
    medians = median_times(comm, fns, runs=runs, alternate=True)
    best = min(range(len(ks)), key=lambda j: medians[j])
    return ks[best] if medians[best] <= (1.0 - min_gain) * medians[0] else 1

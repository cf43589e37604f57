"""From the ranks' raw histories to one record per run (the metrics JSON, a compare row).

The fields are the same for ``train --json`` and ``compare``; each is defined in
``docs/benchmarking.md``, "The fields of a run record".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from commfuse.cluster.machine import cores_left


def _smoothing_window(steps: int) -> int:
    """Moving-average window: a tenth of the run, at least 1, at most 20 steps."""
    return max(1, min(20, steps // 10))


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _machine_busy(
    hist: dict[str, list[float]], cores: int | None, timed: slice
) -> tuple[float | None, float | None]:
    """(cpu_floor_s, machine_busy) over the timed steps whose busy time is known."""
    recorded = hist.get("busy_cpu_s")
    if recorded is None:  # a history from before busy time was recorded
        return None, None
    steps = hist["step_time_s"][timed]
    pairs = [(busy, step) for busy, step in zip(recorded[timed], steps, strict=True) if busy >= 0]
    if not cores or not pairs:
        return None, None
    busy_s = sum(busy for busy, _ in pairs) / cores
    return busy_s / len(pairs), busy_s / sum(step for _, step in pairs)


def bound_parts(
    hist: dict[str, list[float]],
    timed: slice,
    rank_result: dict[str, Any],
    compute_step_s: float | None,
) -> dict[str, float | None]:
    """``exchange_cpu_s``, ``compute_machine_busy`` and ``machine_bound_s`` (module docstring)
    from one reader rank's history and readings (``loop.py``); None where one is missing."""
    none: dict[str, float | None] = dict.fromkeys(
        ("exchange_cpu_s", "compute_machine_busy", "machine_bound_s")
    )
    run, compute = rank_result.get("others_over_run"), rank_result.get("compute_machine")
    cores = rank_result.get("cores")
    busy = hist.get("machine_busy_s")
    steps = len(rank_result.get("compute_step_time_s") or [])
    if not (run and compute and cores and busy and steps and compute_step_s):
        return none
    known = [(b, t) for b, t in zip(busy[timed], hist["step_time_s"][timed], strict=True) if b >= 0]
    if not known or run["wall_s"] <= 0:
        return none
    others_cores = max(0.0, run["others_s"] / run["wall_s"])
    # The ranks' and the kernel's core time: the machine's, less other programs' at their rate.
    step_cpu = statistics.fmean(b - others_cores * t for b, t in known)
    compute_cpu = (compute["busy_s"] - compute["others_s"]) / steps
    exchange = step_cpu - compute_cpu
    left = cores_left(cores, others_cores)
    return {
        "exchange_cpu_s": exchange,
        "compute_machine_busy": compute_cpu / (cores * compute_step_s),
        "machine_bound_s": compute_step_s + max(0.0, exchange) / left,
    }


def ranks_mean(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per step, the mean over the ranks of ``per_rank[r][step]`` (the steps every rank has).

    Ranks that share cores split them differently at every step: the mean over the ranks is
    what the step cost the machine, and it does not carry that split (the module docstring).
    """
    if not per_rank:
        return []
    steps = min(len(times) for times in per_rank)
    return [statistics.fmean(times[i] for times in per_rank) for i in range(steps)]


def phase_step_s(
    step_times_s: Sequence[float], period_steps: int | None, offset: int = 0
) -> list[float] | None:
    """Per position of the period (0 to ``period_steps - 1``), the median step time at that
    position: step ``offset + i`` of ``step_times_s[i]`` is at position ``(offset + i) %
    period_steps``. None when there is no period or no step; a position no step reached is
    left out (a run shorter than the period)."""
    if period_steps is None or not step_times_s:
        return None
    phases: dict[int, list[float]] = {}
    for i, t in enumerate(step_times_s):
        phases.setdefault((offset + i) % period_steps, []).append(t)
    return [statistics.median(phases[p]) for p in sorted(phases)]


def worst_phase_step_s(
    step_times_s: Sequence[float], period_steps: int | None, offset: int = 0
) -> float | None:
    """The largest, over the positions of a period, of the median step time at that position
    (``phase_step_s``). None when there is no period or no step."""
    phases = phase_step_s(step_times_s, period_steps, offset)
    return None if phases is None else max(phases)


def _waits(
    waits: Sequence[float] | None, period: int | None, timed: slice, steps: int
) -> dict[str, Any]:
    """``mean_exchange_wait_s`` and ``phase_exchange_wait_s`` from one wait per step of the
    last ``len(waits)`` steps of the run (empty without them)."""
    if not waits:
        return {}
    first = steps - len(waits)  # the steps before waited for nothing (DreamDDP's profile)
    timed_waits = [(first + k, w) for k, w in enumerate(waits) if first + k >= timed.start]
    if not timed_waits:
        return {}
    phases: dict[int, list[float]] = {}
    for step, w in timed_waits:
        phases.setdefault(step % period if period else 0, []).append(w)
    return {
        "mean_exchange_wait_s": statistics.fmean(w for _, w in timed_waits),
        "phase_exchange_wait_s": [statistics.median(phases[p]) for p in sorted(phases)],
    }


def summarize(
    rank_results: Sequence[dict[str, Any]], *, strategy: str, workload: str, warmup: int
) -> dict[str, Any]:
    """One JSON-able record from every rank's ``train_rank`` result."""
    first = rank_results[0]
    full = first["history"]
    total = len(full["loss"])
    # Entries past the run's ``steps`` (``TrainConfig.extra_steps``) only extend the curves.
    steps = total - int(first.get("extra_steps", 0))
    hist = {k: v[:steps] for k, v in full.items()}
    losses = [statistics.fmean(r["history"]["loss"][i] for r in rank_results) for i in range(total)]
    curve = _moving_average(losses, _smoothing_window(steps))
    times = hist["step_time_s"]
    timed = slice(min(warmup, max(0, steps - 1)), steps)
    wall, walls = 0.0, []
    for i, t in enumerate(full["step_time_s"]):
        wall += t if i else 0.0
        walls.append(wall)
    busy_floor_s, busy_share = _machine_busy(hist, first.get("cores"), timed)
    # Every rank's own step times (rank 0's alone where the ranks' histories differ in length).
    per_rank = [r["history"]["step_time_s"][:steps] for r in rank_results]
    ranks_steps = ranks_mean(per_rank) if min(map(len, per_rank)) == steps else times
    compute = ranks_mean(
        [r["compute_step_time_s"] for r in rank_results if r.get("compute_step_time_s")]
    )
    evaluation = first.get("eval") or {}
    strategy_metrics = first.get("strategy_metrics") or {}
    final_sync = float(strategy_metrics.get("final_sync_bytes", 0))
    period = strategy_metrics.get("period_steps", 1)
    return {
        "strategy": strategy,
        "workload": workload,
        "world_size": len(rank_results),
        "steps": steps,
        "step_time_s": statistics.median(times[timed]),
        "compute_step_time_s": statistics.median(compute) if compute else None,
        "mean_step_time_s": statistics.fmean(times[timed]),
        "period_steps": period,
        "worst_phase_step_s": worst_phase_step_s(ranks_steps[timed], period, timed.start),
        "phase_step_s": phase_step_s(ranks_steps[timed], period, timed.start),
        "cpu_floor_s": busy_floor_s,
        "machine_busy": busy_share,
        **bound_parts(hist, timed, first, statistics.median(compute) if compute else None),
        # Over all steps: warm-up steps send as much as any, and a periodic strategy's
        # synchronisations must be averaged over the whole period.
        "bytes_per_step": statistics.fmean(hist["bytes"]),
        # The end-of-training synchronisation (local SGD's ``final_sync``) is charged to the
        # last step but is not part of the periodic schedule whose burst this measures.
        "peak_bytes_per_step": max([*hist["bytes"][:-1], hist["bytes"][-1] - final_sync]),
        "final_sync_bytes": final_sync,
        # A method that synchronises now and then (the local-SGD family): its exchanges' mean
        # (papers quote bytes per synchronisation or per step; this is the first, the line
        # above the second). None for a strategy that exchanges every step.
        "bytes_per_sync": strategy_metrics.get("bytes_per_sync"),
        "syncs": strategy_metrics.get("syncs"),
        # The local-SGD family: the steps that synchronised; SelSync: its signal per step.
        "sync_steps": strategy_metrics.get("sync_steps"),
        "signals": strategy_metrics.get("signals"),
        # DreamDDP: per iteration of the period, the exchange time and the stall its plan
        # expects (the part the computation before each layer's use does not hide).
        "planned_iterations": strategy_metrics.get("planned_iterations"),
        # DreamDDP: the seconds a step waited for exchanges, the mean over the timed steps and
        # the median at each position of the period (positions as ``worst_phase_step_s``'s).
        **_waits(strategy_metrics.get("exchange_wait_s"), period, timed, steps),
        # DreamDDP with ``trace=1``: every rank's timeline of every exchange.
        **(
            {"exchange_trace": [r["strategy_metrics"]["exchange_trace"] for r in rank_results]}
            if strategy_metrics.get("exchange_trace")
            else {}
        ),
        # A steady-state step (after warm-up; a compressor's uncompressed warm-up excluded).
        "median_bytes_per_step": statistics.median(hist["bytes"][timed]),
        "bytes_total": sum(hist["bytes"]),
        "skipped_steps": int(sum(hist["skipped"])),
        "final_loss": curve[steps - 1],
        "eval_loss": evaluation.get("loss"),
        "eval_accuracy": evaluation.get("accuracy"),
        "wall_s": walls[steps - 1],
        "extra_steps": total - steps,
        "first_step_s": times[0],
        "loss_curve": curve,
        "wall_curve_s": walls,
        "digest": first["digest"],
        "ranks_agree": len({r["digest"] for r in rank_results}) == 1,
    }


def time_to_loss_s(record: dict[str, Any], target: float) -> float | None:
    """Wall time at which the record's smoothed loss first reaches ``target`` (None: never)."""
    for loss, wall in zip(record["loss_curve"], record["wall_curve_s"], strict=True):
        if loss <= target:
            return float(wall)
    return None

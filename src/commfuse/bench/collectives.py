"""``commfuse bench collectives``: an nccl-tests style sweep of collectives over sizes.

Each (op, size) is timed ``iters`` rounds after ``warmup`` untimed runs; in each round every
algorithm runs once, in the balanced orders of ``bench/schedule.py`` (every algorithm in every
position equally often). Every timed sample starts after a barrier and runs the collective
``calls`` times back to back (each after resetting its buffer), as nccl-tests times a loop of
iterations: ``calls`` is the same for every algorithm of a row and every rank, enough that the
fastest algorithm's sample lasts ``min_sample_ms`` by its last warm-up run, so a small message's
time is not one call's scheduling jitter. A sample's time per call is the slowest rank's
(a collective is done when its last rank is done), and the row reports the median over rounds,
with algbw, busbw and, on an emulated cluster, busbw as a percent of the host link rate, the
physical limit there. With ``control`` the first algorithm also runs as a second variant on
buffers of its own (``native'``): the ratio of their medians is the noise floor, and a ratio
within it is a tie.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import torch

from commfuse.bench.cases import Case, bus_factor, make_case
from commfuse.bench.schedule import Schedule, summarize
from commfuse.bench.tuner_report import pick_stats
from commfuse.cluster.topology import Topology
from commfuse.collectives.registry import COLLECTIVES
from commfuse.collectives.trial import exploring, outcomes
from commfuse.comm import Communicator
from commfuse.comm.clock import now
from commfuse.comm.communicator import default_config


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveBenchConfig:
    """What to sweep."""

    ops: tuple[str, ...] = ("all_reduce",)
    """Collectives to time, from COLLECTIVES."""
    sizes_bytes: tuple[int, ...] = (1 << 20,)
    """Message sizes S (nccl-tests' convention per op)."""
    iters: int = 10
    """Timed repetitions per row; the median is reported."""
    warmup: int = 2
    """Untimed repetitions before timing (connection set-up, allocator)."""
    dtype: str = "float32"
    """Element type of the buffers."""
    algos: tuple[str, ...] = ("native",)
    """Algorithms to time side by side; "all" expands to every registered one, "auto" lets the
    tuner pick. Rows of one (op, size) run in balanced rounds so noise hits them alike."""
    control: bool = False
    """Time the first algorithm twice (A/A): the noise floor of the ratios."""
    min_sample_ms: float = 0.0
    """Repeat the call within a sample until the fastest algorithm's sample lasts this long
    (judged by the last warm-up run; 0: one call per sample)."""
    max_calls_per_sample: int = 1000
    """The most calls one sample may repeat."""
    seed_order: int | None = 0
    """Seed of the rounds' balanced orders."""
    tuner_trial_calls: int = 0
    """``CommConfig.tuner_trial_calls`` of the communicator the sweep makes: with K > 0, ``auto``
    settles each size by a timed trial (K calls per candidate) before its row is timed."""
    emulated: bool = False
    """Whether the ranks run on an emulated network (netlab); recorded in every row."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in COLLECTIVES]
        if unknown:
            raise ValueError(
                f"unknown op {', '.join(unknown)} in ops: use one or more of {', '.join(COLLECTIVES)}"
            )
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")
        if self.tuner_trial_calls < 0:
            raise ValueError("tuner_trial_calls must be >= 0")
        if self.min_sample_ms < 0 or self.max_calls_per_sample < 1:
            raise ValueError("min_sample_ms must be >= 0 and max_calls_per_sample >= 1")
        if any(size <= 0 for size in self.sizes_bytes):
            raise ValueError("sizes_bytes must all be positive")


def bench_collectives_on_rank(
    config: CollectiveBenchConfig, comm: Communicator | None = None
) -> list[dict[str, Any]]:
    """Runs on every rank (the process group is up) over ``comm`` (default: a new one over the
    world); rank 0's return value is the report."""
    if comm is None:
        settings = dataclasses.replace(default_config(), tuner_trial_calls=config.tuner_trial_calls)
        comm = Communicator(config=settings)
    topology = Topology.of_rank(comm.world_size)
    dtype = getattr(torch, config.dtype)
    records: list[dict[str, Any]] = []
    for op in config.ops:
        algos = expand_algos(op, config.algos)
        for size in config.sizes_bytes:
            schedule = Schedule(
                tuple(algos), rounds=config.iters, control=config.control, seed=config.seed_order
            )
            # The control's copy gets buffers of its own: A and A' differ in nothing but memory.
            cases = {
                name: make_case(comm, op, size, dtype, schedule.code_of(name))
                for name in schedule.names
            }
            names = list(schedule.names)
            last_warmup = torch.zeros(len(names), dtype=torch.float64, device=comm.device)
            for c, name in enumerate(names):
                case = cases[name]
                for _ in range(config.warmup):
                    case.reset()
                    comm.barrier()
                    start = now(comm.device)
                    case.call()
                    last_warmup[c] = now(comm.device) - start
                if schedule.code_of(name) == "auto":
                    _settle_trial(comm, op, case)
            calls = calls_per_sample(comm, config, last_warmup)
            times = torch.zeros(len(names), config.iters, dtype=torch.float64, device=comm.device)
            wrong = torch.zeros(len(names), dtype=torch.int64, device=comm.device)
            for i, order in enumerate(schedule.orders()):  # the same seeded orders on every rank
                for name in order:
                    c, case = names.index(name), cases[name]
                    comm.barrier()
                    start = now(comm.device)
                    for _ in range(calls):
                        case.reset()
                        case.call()
                    times[c, i] = (now(comm.device) - start) / calls
                    wrong[c] += case.count_wrong()  # the last call's result
            # A collective takes as long as its slowest rank: max over ranks, then the median.
            comm.all_reduce(times, "max")
            comm.all_reduce(wrong, "sum")
            summary = summarize(
                {name: times[c].tolist() for c, name in enumerate(names)},
                baseline=schedule.baseline,
                control=schedule.control_variant,
                paired=False,  # the time column is the median: its ratio is the medians'
            )
            baseline = summary.medians[schedule.baseline]
            for c, name in enumerate(names):
                record = _record(
                    config,
                    comm,
                    topology,
                    op,
                    schedule.code_of(name),
                    cases[name].size_bytes,
                    times[c],
                    int(wrong[c]),
                    baseline,
                )
                record["variant"] = name
                record["calls_per_sample"] = calls
                if schedule.code_of(name) == "auto":
                    record["trial"] = _trial_record(comm, op, cases[name].size_bytes)
                record.update(summary.as_dict())
                record["tie"] = (
                    summary.is_tie(record["speedup_vs_first"], variant=name)
                    if name != schedule.baseline
                    else None
                )
                # the interval of this variant's per-round time over the baseline's
                record["ratio_ci"] = list(summary.ratio_intervals[name])
                records.append(record)
            mark_regret(records[-len(names) :], control=schedule.control_variant)
    return records


def _settle_trial(comm: Communicator, op: str, case: Case) -> None:
    """Run ``case``, an ``auto`` one, until its timed trial has decided (nothing to do when
    trials are off): the row then times the decision, and the trial's own calls, which ran
    every candidate, are reported apart (``_trial_record``)."""
    while exploring(comm, op, case.size_bytes):
        case.reset()
        case.call()


def _trial_record(comm: Communicator, op: str, size_bytes: int) -> dict[str, Any] | None:
    """What ``auto``'s trial of this row measured: candidates, their medians (slowest rank's)
    and the choice; None without a trial."""
    for outcome in outcomes(comm):
        if (outcome.collective, outcome.nbytes) == (op, size_bytes):
            return {
                "candidates": list(outcome.candidates),
                "median_us": [m * 1e6 for m in outcome.median_s],
                "chosen": outcome.chosen,
                "calls": len(outcome.candidates) * (1 + comm.config.tuner_trial_calls),
            }
    return None


def calls_per_sample(comm: Communicator, config: CollectiveBenchConfig, last: torch.Tensor) -> int:
    """How many calls one sample repeats, the same on every rank: enough for the fastest
    variant's last warm-up time (the slowest rank's) to fill ``min_sample_ms``, at least 1 and
    at most ``max_calls_per_sample``."""
    if config.min_sample_ms <= 0 or config.warmup == 0:
        return 1
    comm.all_reduce(last, "max")  # every rank then computes the same count
    fastest_s = float(last.min())
    if fastest_s <= 0:
        return config.max_calls_per_sample
    wanted = math.ceil(config.min_sample_ms / 1e3 / fastest_s)
    return max(1, min(config.max_calls_per_sample, wanted))


def mark_regret(row: list[dict[str, Any]], *, control: str | None = None) -> None:
    """Give the ``auto`` record of one (op, size) the fastest algorithm timed beside it
    (``best_algo``, its median ``best_us``) and ``regret``: auto's median over that one's, less 1
    (0 where auto ran the best, below 0 where its run beat that same algorithm's own run;
    within the A/A control's noise it is no loss). Only algorithms
    count, not the control's copy, so ``--algo native,auto,all`` measures auto against every
    algorithm at every size; with ``--algo native,auto`` the best is native or auto's own pick."""
    auto = next((r for r in row if r["variant"] == "auto"), None)
    if auto is None:
        return
    timed = [r for r in row if r["variant"] not in ("auto", control)]
    # auto ran one of the algorithms; if that one was not timed on its own, auto's run counts.
    timed = timed if any(r["algo"] == auto["chosen"] for r in timed) else [*timed, auto]
    best = min(timed, key=lambda r: r["time_us"])
    auto["best_algo"] = best["chosen"]
    auto["best_us"] = best["time_us"]
    auto["regret"] = auto["time_us"] / best["time_us"] - 1.0


def auto_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op and layout: how often ``auto`` picked each algorithm over the sizes timed, and
    its regret against the best algorithm measured at each size (median and worst)."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("variant", r["algo"]) == "auto" and "regret" in r:
            key = (r["op"], r.get("hosts", 1), r.get("ranks_per_host", 1))
            groups.setdefault(key, []).append(r)
    return [
        {
            "op": op,
            "hosts": hosts,
            "ranks_per_host": local,
            **pick_stats(
                [r["chosen"] for r in rows],
                [r["regret"] for r in rows],
                best_picked=sum(r["chosen"] == r["best_algo"] for r in rows),
            ),
        }
        for (op, hosts, local), rows in groups.items()
    ]


def expand_algos(op: str, algos: tuple[str, ...], *, strict: bool = False) -> list[str]:
    """Resolve "all" and aliases; the first entry is the baseline of the ratio column.

    A name this collective does not have is skipped (``--algo lp,ring`` over several ops runs
    what each op has), or refused with ``strict``."""
    from commfuse.collectives.registry import algorithms_for, resolve

    known = algorithms_for(op)
    out: list[str] = []
    for algo in algos:
        names = ["native", *sorted(n for n in known if n != "native")] if algo == "all" else [algo]
        for alias in names:
            name = resolve(op, alias)
            if name != "auto" and name not in known:
                if not strict:
                    continue
                raise ValueError(
                    f"unknown {op} algorithm {name!r}: use all, auto or one of {', '.join(sorted(known))}"
                )
            if name not in out:
                out.append(name)
    return out


def _record(
    config: CollectiveBenchConfig,
    comm: Communicator,
    topology: Topology,
    op: str,
    algo: str,
    size_bytes: int,
    times: torch.Tensor,
    wrong: int,
    baseline_s: float,
) -> dict[str, Any]:
    from commfuse.collectives.profile import profile_of
    from commfuse.collectives.tuner import choose, predict

    link_gbit = topology.link_gbit
    seconds = statistics.median(times.tolist())
    chosen: object = choose(comm, op, size_bytes) if algo == "auto" else algo
    effective = chosen if isinstance(chosen, str) else str(chosen[0])  # type: ignore[index]
    predicted_s = predict(op, effective, size_bytes, comm.world_size, profile_of(comm))
    algbw = size_bytes / seconds / 1e9
    busbw = algbw * bus_factor(op, comm.world_size)
    return {
        "op": op,
        "algo": algo,
        # what "auto" ran (the algorithm itself otherwise)
        "chosen": effective,
        # the tuner's cost model for this algorithm and size (None when it has no model)
        "predicted_us": None if predicted_s == float("inf") else predicted_s * 1e6,
        "bytes": size_bytes,
        "dtype": config.dtype,
        "world_size": comm.world_size,
        "hosts": topology.num_hosts,
        "ranks_per_host": topology.ranks_per_host,
        "link_gbit": link_gbit,
        "emulated": config.emulated,
        "time_us": seconds * 1e6,
        "time_us_min": float(times.min()) * 1e6,
        # baseline (the first algorithm) time / this time: > 1 means faster
        "speedup_vs_first": baseline_s / seconds,
        "iters": config.iters,
        "algbw_GBps": algbw,
        "busbw_GBps": busbw,
        "link_pct": None if link_gbit is None else 100.0 * busbw / (link_gbit / 8.0),
        # wrong elements per run, summed over ranks (a correct collective has 0)
        "wrong": wrong // config.iters,
    }

"""Strategies' step times side by side in one job (``commfuse bench strategies``).

``commfuse compare`` trains each strategy in a job of its own, one after the other: right for
losses and time to a loss, too coarse for step times a few percent apart, because this kind of
machine drifts by 5-10% between jobs. Here every rank builds every strategy on its own copy of
the same model and optimizer, trains each ``warmup_steps`` untimed steps (past compressors'
warm-up and torch DDP's bucket rebuild), then times ``reps`` rounds in which each strategy runs
``steps`` steps, in the balanced orders of ``bench/schedule.py`` (every strategy in every
position equally often), each block after a barrier and as the slowest rank's time. A
strategy's ratio is the median over rounds of its block time over the first strategy's in the
same round, so a drift hits both sides of every ratio alike. Every strategy sees the same
batches (step ``i`` of each is the workload's batch ``i``). With ``control`` the first strategy
is built and timed twice (A and A'); A'/A is the noise floor, and a ratio within it is a tie.

Also reported per strategy: the median phases of rank 0's steps (forward, backward up to the
synchronised gradients, optimizer step), the CPU seconds a rank's threads spent per step (mean
over ranks: where ranks share cores, CPU spent on communication is compute another rank lacks),
the CPU floor of its step (the busy time of this machine's ranks and the kernel's softirqs
during its blocks, divided by the cores, per step: ``cluster/machine.py``; where the step is
close to it, the step is CPU-bound and no overlap can shorten it) and the bytes it handed to
collectives per timed step; and, unless ``include_compute`` is off, the bare model with no
communication at all (``compute``): the floor every step time is measured against.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commfuse.bench.schedule import Schedule, control_name, run_rounds, summarize
from commfuse.cluster import machine
from commfuse.comm import Communicator
from commfuse.comm.clock import now
from commfuse.train.strategy import (
    StrategyConfig,
    StrategyContext,
    build_strategy,
    check_strategy,
    describe_strategy,
)
from commfuse.workloads import (
    CharLMConfig,
    WorkloadConfig,
    check_workload,
    describe_workload,
    make_workload,
)

#: The name of the bare-model row.
COMPUTE = "compute"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategiesBenchConfig:
    """What to time (see the module docstring)."""

    strategies: tuple[StrategyConfig, ...]
    """Strategy configs as for ``commfuse train``; the first is the baseline of the ratios."""
    labels: tuple[str, ...] = ()
    """Their names in the records (default: ``describe_strategy``)."""
    workload: WorkloadConfig = dataclasses.field(default_factory=CharLMConfig)
    steps: int = 6
    """Steps per timed block."""
    reps: int = 5
    """Timed rounds (blocks per strategy); medians are reported."""
    warmup_steps: int = 3
    """Untimed steps of each strategy first."""
    bucket_cap_mb: float = 25.0
    seed: int = 0
    include_compute: bool = True
    """Also time the bare model (no communication): the floor."""
    control: bool = False
    """Build and time the first strategy twice (A/A): its ratio is the noise floor."""
    seed_order: int | None = 0
    """Seed of the rounds' balanced orders (``bench/schedule.py``)."""

    def __post_init__(self) -> None:
        if not self.strategies:
            raise ValueError("give at least one strategy")
        for strategy in self.strategies:
            check_strategy(strategy)  # ValueError naming what a strategy may be
        if len({describe_strategy(s) for s in self.strategies}) != len(self.strategies):
            raise ValueError("a strategy is given twice")
        if self.labels and len(self.labels) != len(self.strategies):
            raise ValueError(f"{len(self.labels)} labels for {len(self.strategies)} strategies")
        for key in ("steps", "reps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        check_workload(self.workload)

    def label(self, index: int) -> str:
        """The name of strategy ``index`` in the records."""
        return self.labels[index] if self.labels else describe_strategy(self.strategies[index])


@dataclasses.dataclass
class _Runner:
    """One strategy (or the bare model) with its own model, optimizer and step counter."""

    name: str
    step_fn: Callable[[int], tuple[float, float, float]]
    bytes_fn: Callable[[], int]
    close: Callable[[], None]
    device: torch.device
    """The ranks' device (``comm.device``): the clock waits for it, the timings travel on it."""
    next_step: int = 0
    blocks_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: list[float] = dataclasses.field(default_factory=list)
    floor_s: list[float] = dataclasses.field(default_factory=list)
    phases: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    bytes_timed: int = 0
    pids: tuple[int, ...] | None = None
    """This machine's ranks, whose CPU is the floor's (``machine.rank_pids``), on the one rank
    of each machine that reads them; None on the others."""

    def run(self, num_steps: int, *, timed: bool) -> None:
        dist.barrier()
        sent = self.bytes_fn()
        busy_start = None if self.pids is None else machine.busy_cpu_s(self.pids)
        start, cpu_start = now(self.device), time.process_time()
        phases = [self.step_fn(self.next_step + i) for i in range(num_steps)]
        elapsed = now(self.device) - start
        busy = None if self.pids is None else machine.busy_since(busy_start, self.pids)
        # CPU seconds of every thread of this rank (compute, gloo's, commfuse's workers): where
        # ranks share cores, a strategy's CPU is other ranks' lost compute.
        cpu = time.process_time() - cpu_start
        sent = self.bytes_fn() - sent  # before the timing allreduce, which is not the strategy's
        slowest = torch.tensor([elapsed / num_steps], dtype=torch.float64, device=self.device)
        cpu_sum = torch.tensor([cpu / num_steps], dtype=torch.float64, device=self.device)
        # The busiest machine's floor (one rank per machine reads it); -1 where a rank does not
        # read or a machine cannot tell (no /proc), so the max says "unknown" only if none can.
        floor = -1.0
        if busy is not None:
            floor = busy / machine.cores() / num_steps
        machine_floor = torch.tensor([floor], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank's block
        dist.all_reduce(cpu_sum)  # every rank's CPU
        dist.all_reduce(machine_floor, op=dist.ReduceOp.MAX)
        self.next_step += num_steps
        if timed:
            self.blocks_s.append(float(slowest))
            self.cpu_s.append(float(cpu_sum) / dist.get_world_size())
            if float(machine_floor) >= 0:
                self.floor_s.append(float(machine_floor))
            self.phases += phases
            self.bytes_timed += sent


def _runners(config: StrategiesBenchConfig, comm: Communicator) -> list[_Runner]:
    device = comm.device  # every model, batch and timing lives on the rank's device
    workload = make_workload(config.workload, device=device)
    rank, world = comm.rank, comm.world_size
    local = machine.rank_pids()
    pids = local if local[0] == os.getpid() else None  # one reader per machine
    runners = []
    # (label, config): the strategies, then the first one again for the A/A control.
    entries = [(config.label(i), spec) for i, spec in enumerate(config.strategies)]
    if config.control:
        entries.append((control_name(config.label(0)), config.strategies[0]))
    for name, spec in entries:
        module = workload.build_model(config.seed)
        optimizer = workload.make_optimizer(module)
        strategy = build_strategy(
            spec,
            StrategyContext(
                module=module,
                optimizer=optimizer,
                comm=comm,
                bucket_cap_mb=config.bucket_cap_mb,
                seed=config.seed,
                run_steps=config.warmup_steps + config.reps * config.steps,
            ),
        )

        def step(i: int, strategy: Any = strategy) -> tuple[float, float, float]:
            batch = workload.batch(i, rank, world, seed=config.seed)
            t0 = now(device)
            with comm.at_step(i):
                strategy.zero_grad()
                loss = workload.loss(strategy.model, batch)
                t1 = now(device)
                strategy.backward(loss)
                strategy.sync()
                t2 = now(device)
                strategy.optimizer_step()
            return t1 - t0, t2 - t1, now(device) - t2

        runners.append(_Runner(name, step, strategy.bytes_sent, strategy.close, device, pids=pids))
    if config.include_compute:
        bare = workload.build_model(config.seed)
        bare_opt = workload.make_optimizer(bare)

        def bare_step(i: int) -> tuple[float, float, float]:
            batch = workload.batch(i, rank, world, seed=config.seed)
            t0 = now(device)
            bare_opt.zero_grad(set_to_none=True)
            loss = workload.loss(bare, batch)
            t1 = now(device)
            loss.backward()  # type: ignore[no-untyped-call]
            t2 = now(device)
            bare_opt.step()
            return t1 - t0, t2 - t1, now(device) - t2

        runners.append(_Runner(COMPUTE, bare_step, lambda: 0, lambda: None, device, pids=pids))
    return runners


def bench_strategies_on_rank(config: StrategiesBenchConfig) -> list[dict[str, Any]]:
    """Run on every rank; returns one record per strategy (its A/A copy, and ``compute``), the
    same on every rank except the phases, which are this rank's."""
    comm = Communicator()
    runners = _runners(config, comm)
    by_name = {runner.name: runner for runner in runners}
    baseline = config.label(0)
    schedule = Schedule(
        tuple(r.name for r in runners if r.name != control_name(baseline) or not config.control),
        rounds=config.reps,
        control=config.control,
        seed=config.seed_order,
    )
    try:
        for runner in runners:
            if config.warmup_steps:
                runner.run(config.warmup_steps, timed=False)
        # The same orders on every rank (seeded); each block's time lands in its runner.
        run_rounds(schedule, lambda name, _round: by_name[name].run(config.steps, timed=True))
    finally:
        for runner in runners:
            runner.close()
    summary = summarize(
        {r.name: r.blocks_s for r in runners}, baseline=baseline, control=schedule.control_variant
    )
    floor = by_name[COMPUTE].blocks_s if config.include_compute else None
    records = []
    for runner in runners:
        forward, backward, optimizer = (
            statistics.median(p[k] for p in runner.phases) for k in range(3)
        )
        ratio = summary.ratios[runner.name]
        record: dict[str, Any] = {
            "strategy": runner.name,
            "workload": describe_workload(config.workload),
            "world_size": comm.world_size,
            "step_s": summary.medians[runner.name],
            "step_s_min": min(runner.blocks_s),
            "step_s_max": max(runner.blocks_s),
            "ratio_to_first": ratio,
            "ratio_min": summary.ratio_ranges[runner.name][0],
            "ratio_max": summary.ratio_ranges[runner.name][1],
            # the A/A control (None without one) and whether this ratio lies within it
            **summary.as_dict(),
            "tie": summary.is_tie(ratio, variant=runner.name) if runner.name != baseline else None,
            "ratio_ci": list(summary.ratio_intervals[runner.name]),
            "forward_s": forward,
            "backward_sync_s": backward,
            "optimizer_s": optimizer,
            "cpu_s_per_step": statistics.median(runner.cpu_s),
            "cpu_floor_s": statistics.median(runner.floor_s) if runner.floor_s else None,
            "bytes_per_step": runner.bytes_timed / (config.reps * config.steps),
            "steps": config.steps,
            "reps": config.reps,
            "warmup_steps": config.warmup_steps,
            "orders": [list(order) for order in schedule.orders()],
        }
        if floor is not None:
            record["step_over_compute"] = statistics.median(
                a / b for a, b in zip(runner.blocks_s, floor, strict=True)
            )
        record["kind"] = "bench strategies"  # commfuse report's table
        records.append(record)
    return records

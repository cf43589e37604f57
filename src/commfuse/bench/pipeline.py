"""Pipeline schedules side by side: step time, the bubble measured against its formula, bytes.

Run on every rank (``commfuse.cluster.run(bench_pipeline_on_rank, config, net=...)``; the
command is ``commfuse bench pipeline``). The same MLP, cut into equal stages, and the same batch
split into ``num_microbatches`` micro-batches, run under each schedule with its own copy of
the model and optimizer:

1. every schedule is timed in rounds of balanced orders (``bench/schedule.py``), each block of
   steps after a barrier and as the slowest rank's time; ratios are to ``sequential`` (no
   pipelining: micro-batches one after another), the median of the per-round ratios; with
   ``control``, ``sequential`` runs twice (A/A) and its ratio is the noise floor;
2. one more step of each runs with the communicator's trace on: the compute actions' busy time
   against the step's span on all ranks is the measured bubble (what ``bubble_of_events``
   reads off the ranks' merged traces), set beside the schedule's formula on equal stages
   (``replay``, unit times, free links);
3. the stage boundaries' bytes of that step, summed over ranks, headers included.

A rank per core is what the formulas assume: where several ranks share a core, compute waits
for the CPU too and the measured bubble mixes both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commfuse.bench.schedule import Schedule, control_name, summarize
from commfuse.comm import CommConfig, Communicator
from commfuse.comm.clock import now
from commfuse.pipeline import (
    PipelineRuntime,
    cut,
    replay,
    schedule_by_name,
)
from commfuse.pipeline.generators import SCHEDULES
from commfuse.pipeline.runtime import LABELS

#: The schedule every ratio is to.
BASELINE = "sequential"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineBenchConfig:
    """What to time."""

    schedules: tuple[str, ...] = ("sequential", "gpipe", "1f1b", "zb_h1")
    """The schedules (``commfuse.pipeline.SCHEDULES``); ``sequential`` is added if missing."""
    num_microbatches: int = 8
    """Micro-batches per step."""
    stages_per_rank: int = 2
    """Stages per rank of ``interleaved_1f1b`` (the others run one)."""
    num_layers: int = 16
    """Linear+Tanh layers of the MLP, cut into equal stages."""
    width: int = 256
    """Width of each layer."""
    batch_size: int = 64
    """Samples per step, split into the micro-batches."""
    num_steps: int = 3
    """Steps per timed block."""
    num_reps: int = 5
    """Timed blocks per schedule (rounds in balanced orders)."""
    control: bool = False
    """Time ``sequential`` twice (A/A): its ratio to itself is the noise floor."""
    seed_order: int | None = 0
    """Seed of the rounds' balanced orders."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(f"schedules {unknown or '()'}: choose from {', '.join(SCHEDULES)}")
        for key in (
            "num_microbatches", "stages_per_rank", "num_layers", "width", "batch_size",
            "num_steps", "num_reps",
        ):  # fmt: skip
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.batch_size < self.num_microbatches:
            raise ValueError(
                f"batch_size {self.batch_size} cannot make {self.num_microbatches} micro-batches"
            )
        if BASELINE not in self.schedules:
            object.__setattr__(self, "schedules", (BASELINE, *self.schedules))


def _model(config: PipelineBenchConfig) -> nn.Sequential:
    torch.manual_seed(0)  # the same model under every schedule and on every rank
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())
            for _ in range(config.num_layers)
        ]
    )


class _Engine:
    """One schedule with its own copy of the model's stages and their optimizer."""

    def __init__(self, name: str, config: PipelineBenchConfig, comm: Communicator) -> None:
        v = config.stages_per_rank if name == "interleaved_1f1b" else 1
        self.schedule = schedule_by_name(
            name,
            num_ranks=comm.world_size,
            num_microbatches=config.num_microbatches,
            stages_per_rank=v,
        )
        stages_count = self.schedule.num_stages
        if config.num_layers < stages_count:
            raise ValueError(
                f"{name}: {config.num_layers} layers cannot make {stages_count} stages"
            )
        edges = [i * config.num_layers // stages_count for i in range(1, stages_count)]
        stages = cut(_model(config).to(comm.device), edges)
        mine = {
            s: stages[s] for s in range(stages_count) if self.schedule.stage_to_rank[s] == comm.rank
        }
        self.runtime = PipelineRuntime(self.schedule, mine, comm, loss_fn=nn.functional.mse_loss)
        params = [p for m in mine.values() for p in m.parameters()]
        self.opt = torch.optim.SGD(params, lr=1e-4)
        # Drawn on the CPU generator and moved: every device gets the same numbers.
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(config.batch_size, config.width, generator=gen, device="cpu")
        y = torch.randn(config.batch_size, config.width, generator=gen, device="cpu")
        m = config.num_microbatches
        self.xs = [t.to(comm.device) for t in x.tensor_split(m)] if 0 in mine else None
        last = stages_count - 1
        self.ys = [t.to(comm.device) for t in y.tensor_split(m)] if last in mine else None

    def step(self) -> None:
        self.runtime.step(self.xs, self.ys)
        self.opt.step()
        self.opt.zero_grad()


def _time_block(step: Callable[[], None], num_steps: int, device: torch.device) -> float:
    dist.barrier()
    start = now(device)
    for _ in range(num_steps):
        step()
    elapsed = torch.tensor([(now(device) - start) / num_steps], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _traced_step(engine: _Engine, comm: Communicator) -> tuple[float, int]:
    """(measured bubble, boundary bytes over all ranks) of one step with the trace on."""
    dist.barrier()
    comm.trace.clear()
    comm.stats.reset()
    engine.step()
    events = [e for e in comm.trace.chrome_events() if str(e["name"]).startswith("pipeline ")]
    busy = sum(float(e["dur"]) for e in events)
    first = min(float(e["ts"]) for e in events)
    last = max(float(e["ts"]) + float(e["dur"]) for e in events)
    sent = sum(comm.stats[label].bytes_sent for label in LABELS.values())
    sums = torch.tensor([busy, float(sent)], dtype=torch.float64, device=comm.device)
    span = torch.tensor([-first, last], dtype=torch.float64, device=comm.device)
    dist.all_reduce(sums)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    whole = float(span[0] + span[1])
    measured = 1.0 - float(sums[0]) / (comm.world_size * whole) if whole > 0 else 0.0
    return measured, int(sums[1])


def bench_pipeline_on_rank(config: PipelineBenchConfig | None = None) -> list[dict[str, Any]]:
    """One record per schedule (the same on every rank): median step, the ratio to the
    sequential step, the bubble measured and its formula, the bytes per step."""
    config = config or PipelineBenchConfig()
    comm = Communicator(config=CommConfig(trace=True))
    twin = control_name(BASELINE)
    engines = {name: _Engine(name, config, comm) for name in config.schedules}
    if config.control:
        engines[twin] = _Engine(BASELINE, config, comm)
    for engine in engines.values():  # warm-up
        _time_block(engine.step, 1, comm.device)
    schedule = Schedule(
        config.schedules, rounds=config.num_reps, baseline=BASELINE, control=config.control,
        seed=config.seed_order,
    )  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in schedule.names}
    for order in schedule.orders():  # the same seeded orders on every rank
        for name in order:
            comm.trace.clear()
            times[name].append(_time_block(engines[name].step, config.num_steps, comm.device))
    summary = summarize(times, baseline=BASELINE, control=schedule.control_variant)
    records = []
    for name in schedule.names:
        engine = engines[name]
        measured, sent = _traced_step(engine, comm)
        ratio = summary.ratios[name]
        records.append(
            {
                "schedule": name,
                "stages": engine.schedule.num_stages,
                "micro_batches": config.num_microbatches,
                "step_s": summary.medians[name],
                "step_s_min": min(times[name]),
                "step_s_max": max(times[name]),
                "sequential_step_s": summary.medians[BASELINE],
                "ratio_to_sequential": ratio,
                "ratio_min": summary.ratio_ranges[name][0],
                "ratio_max": summary.ratio_ranges[name][1],
                **summary.as_dict(),
                "tie": summary.is_tie(ratio, variant=name) if name != BASELINE else None,
                "ratio_ci": list(summary.ratio_intervals[name]),
                "bubble_measured": measured,
                "bubble_formula": replay(engine.schedule).bubble_fraction,
                "bytes_per_step": sent,
                "world_size": comm.world_size,
                "num_layers": config.num_layers,
                "width": config.width,
                "batch_size": config.batch_size,
                "num_steps": config.num_steps,
                "num_reps": config.num_reps,
                "orders": [list(order) for order in schedule.orders()],
            }
        )
    return records

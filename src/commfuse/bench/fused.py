"""``commfuse bench fused``: each fused operator against its unfused reference, side by side.

For every (op, shape) each rank times, in rounds whose orders ``bench/schedule.py`` balances
(every variant in every position equally often), after a barrier each:

1. ``compute``: the computation alone (``C``); ``comm``: the collective alone, on a buffer of
   the result's size (``M``);
2. ``unfused``: the reference, computation then collective;
3. ``fused``: the chunked pipeline with ``k`` chosen by the cost model from the measured ``C``,
   ``M`` and per-chunk overhead (or ``--chunks``); ``fused[NAME]``: the operator's other
   schedules, each a row of its own;
4. ``overlap``: the computation and the collective started together with no dependency between
   them: what perfect overlap costs on this machine, where the two share the cores;
5. ``stage:NAME`` (the MoE step): parts of the step timed alone, for the dependency-aware bound.

The ratios ``fused/dep``, ``fused/bound`` and ``fused/graph`` divide by bounds of increasing
completeness: the dependencies with the ranks' CPU floor (``bench/cpu_floor.py``), the machine's
bound (the kernel's network work and other programs' cores too), and the bound of the step's
graph on the machine's cores (``sim.bound.step_bound``).

A run's time is the slowest rank's; a row reports medians, the ideal ``max(C, M)``, the model's
prediction and the ratios fused/unfused, fused/ideal and fused/overlap (of the medians), plus
``wrong``: elements where the fused result differs from the unfused one (both reduce in the
same order, so it must be 0). With ``control`` the unfused reference runs twice per round (U
and U'): U'/U is the noise floor, and a fused/unfused ratio within it is a tie. Each operator is
described by its ``FusedForms``; the benchmark turns them into one ``Case`` per variant.

Design notes: ``docs/benchmarking.md``, "The variants and bounds of commfuse bench fused".
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch

from commfuse.bench.cases import Case
from commfuse.bench.cpu_floor import cpu_seconds
from commfuse.bench.machine_rounds import Rounds, machine_reader
from commfuse.bench.schedule import Schedule, summarize
from commfuse.bench.table import ratio_cell
from commfuse.cluster.topology import Topology
from commfuse.collectives import all_to_all
from commfuse.comm import Communicator
from commfuse.comm.clock import now
from commfuse.fused import baselines
from commfuse.fused import embedding_all_to_all as emb
from commfuse.fused import gemm_all_reduce as gar
from commfuse.fused.chunking import (
    BY_TABLE,
    ChunkConfig,
    ChunkSchedule,
    choose_chunks,
    measure_overhead_us,
    predict_us,
    split_sizes,
)
from commfuse.sim.bound import StepGraph, step_bound

#: Operators this benchmark knows, and the shapes it times for each by default:
#: - GEMM + AllReduce: (rows, in_features, out_features), in_features sharded across ranks;
#: - embedding + All-to-All: (global batch, tables, rows per table, dim, lookups per bag);
#: - GEMM + All-to-All (bench/fused_moe.py): (rows per rank, in_features, out_features,
#:   experts per rank); ``moe_step`` is a training step of workloads/moe.py with (tokens per
#:   rank, d_model, d_hidden, experts per rank);
#: - sequence-parallel rings (bench/fused_sequence.py): (sequence, in_features, out_features).
FUSED_OPS: dict[str, tuple[tuple[int, ...], ...]] = {
    "gemm_all_reduce": ((1024, 2048, 1024), (1024, 8192, 512), (2048, 512, 1024)),
    "gemv_all_reduce": ((1, 8192, 16384),),
    "embedding_all_to_all": (
        (4096, 32, 20000, 64, 16),
        (4096, 32, 20000, 64, 64),
        (8192, 32, 20000, 64, 4),
    ),
    "gemm_all_to_all": ((2048, 256, 1024, 2), (2048, 1024, 1024, 2), (4096, 64, 1024, 2)),
    "moe_step": ((1024, 512, 512, 2),),
    "all_gather_gemm": ((4096, 1024, 4096), (4096, 1024, 1024), (1024, 2048, 8192)),
    "gemm_reduce_scatter": ((4096, 4096, 1024), (4096, 1024, 1024), (1024, 8192, 2048)),
}
#: Numbers in each operator's shape.
_ARITY = {op: len(shapes[0]) for op, shapes in FUSED_OPS.items()}


def check_schedule(
    chunks: int | None,
    schedule: str | None,
    names: tuple[str, ...],
    *,
    by_table: tuple[str, ...],
) -> ChunkSchedule | None:
    """The fixed schedule of ``chunks`` and ``schedule`` (None: the operators choose);
    ValueError unless ``chunks`` is None or >= 1, and ``schedule="by_table"`` (the embedding
    exchange's schedule; no other has one) comes without ``chunks`` and with only operators or
    steps in ``by_table``."""
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if schedule is None:
        return chunks
    if schedule != BY_TABLE:
        raise ValueError(f"schedule must be {BY_TABLE!r} or None, got {schedule!r}")
    if chunks is not None:
        raise ValueError(f"schedule={BY_TABLE!r} has no chunks: leave chunks None")
    others = [name for name in names if name not in by_table]
    if others:
        raise ValueError(
            f"schedule={BY_TABLE!r} is a schedule of the embedding exchange only "
            f"({', '.join(by_table)}); {', '.join(others)} take(s) chunks"
        )
    return BY_TABLE


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedBenchConfig:
    """What to time."""

    ops: tuple[str, ...] = tuple(FUSED_OPS)
    """Operators, from FUSED_OPS."""
    iters: int = 7
    """Timed repetitions per variant; medians are reported."""
    warmup: int = 2
    """Untimed runs of each variant first (connections, allocator, the measurement of k)."""
    chunks: int | None = None
    """Fixed number of chunks (>= 1); None lets the cost model choose."""
    schedule: Literal["by_table"] | None = None
    """``"by_table"``: the embedding exchange's by-table schedule (embedding_all_to_all only)
    instead of chunks."""
    shapes: tuple[tuple[int, ...], ...] | None = None
    """Shapes to time instead of the defaults; each op takes those of its arity (3 or 5)."""
    control: bool = False
    """Time the unfused reference twice per round (A/A): the noise floor of fused/unfused."""
    seed_order: int | None = 0
    """Seed of the rounds' balanced orders."""
    emulated: bool = False
    """Whether the ranks run on an emulated network (netlab); recorded in every row."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in FUSED_OPS]
        if unknown:
            raise ValueError(
                f"unknown op {', '.join(unknown)} in ops: use one or more of {', '.join(FUSED_OPS)}"
            )
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")
        # --shape picks ops by arity: ops with no shape of theirs are skipped, unless none has any.
        if self.shapes and not any(self.shapes_of(op) for op in self.ops):
            missing = self.ops[0]
            raise ValueError(f"no shape of {_ARITY[missing]} dimensions for {missing} in shapes")
        self.fixed()

    def fixed(self) -> ChunkSchedule | None:
        """The schedule every op runs with (None: each op's own choice)."""
        return check_schedule(
            self.chunks, self.schedule, self.ops, by_table=("embedding_all_to_all",)
        )

    def shapes_of(self, op: str) -> tuple[tuple[int, ...], ...]:
        if self.shapes is None:
            return FUSED_OPS[op]
        return tuple(s for s in self.shapes if len(s) == _ARITY[op])


@dataclasses.dataclass
class FusedForms:
    """The four forms of one fused operator at one (op, shape), from which the benchmark builds
    its cases; ``fused`` takes the number of chunks."""

    compute: Callable[[], Any]
    comm: Callable[[], Any]
    unfused: Callable[[], torch.Tensor]
    fused: Callable[[int], torch.Tensor]
    max_chunks: int
    choose: Callable[[], ChunkSchedule] | None = None
    """The operator's own chunk choice (measures and may fall back to 1), if it has one."""
    by_table: Callable[[], torch.Tensor] | None = None
    """The operator by table (the embedding exchange's schedule), if it has one."""
    stages: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    """Parts of the operator timed alone in the same rounds (``stage:NAME``), by name: the
    inputs of ``bound``."""
    bound: Callable[[dict[str, float], dict[str, float]], float] | None = None
    """The dependency-aware bound from the medians of ``compute``, ``comm`` and the stages
    (by name), where the operator's dependencies let less overlap than perfect overlap does,
    and the stages' CPU floors (by name: what their CPU needs of the machine's cores)."""
    graph: Callable[..., StepGraph] | None = None
    """The step's dependency graph for ``sim.bound.step_bound`` from the medians (wall) and the
    CPU (all ranks) of ``compute`` and the stages (by name), given ``floor_us`` (the machine
    floor) and ``cores`` (those left to the ranks), where the operator has one."""
    alternatives: dict[str, Callable[[], torch.Tensor]] = dataclasses.field(default_factory=dict)
    """Other schedules, by name, timed in the same rounds as the chosen one; each gets a row
    of its own (op ``"op[name]"``) sharing the chosen row's C, M, unfused, overlap and
    control."""

    def fused_at(self, chunks: ChunkSchedule) -> Callable[[], torch.Tensor]:
        """The fused form with ``chunks`` (a count, or by table where the operator has it)."""
        if isinstance(chunks, int):
            return functools.partial(self.fused, chunks)
        assert self.by_table is not None  # check_schedule admits it for such operators only
        return self.by_table


def _gemm_case(comm: Communicator, shape: tuple[int, ...]) -> FusedForms:
    rows, in_features, out_features = shape
    gen = torch.Generator().manual_seed(comm.rank)
    shard = split_sizes(in_features, comm.world_size)[comm.rank]
    # Drawn on the CPU generator and moved: every device gets the same numbers.
    x = torch.randint(-2, 3, (rows, shard), generator=gen, device="cpu").float().to(comm.device)
    w = torch.randint(-2, 3, (out_features, shard), generator=gen, device="cpu").float()
    w = w.to(comm.device)
    buf = torch.zeros(rows, out_features, device=comm.device)
    world, local = comm.world_size, comm.config.ranks_per_host or 1
    # M is the reference's own all-reduce (baselines.all_reduce_algo: in two levels on
    # two-level layouts), so that C, M, overlap and unfused describe the same baseline.
    reference_algo = baselines.all_reduce_algo(buf.numel() * buf.element_size(), world, local)
    alternatives: dict[str, Callable[[], torch.Tensor]] = {}
    if rows >= comm.world_size:  # the row path's schedules (a GEMV has one)
        alternatives[f"ring k={world}"] = functools.partial(
            gar.gemm_all_reduce, comm, x, w, chunks=world, schedule="ring"
        )
        if reference_algo == "hierarchical":
            # The unfused GEMM with gloo's flat ring all-reduce: the reference one level down.
            alternatives["unfused flat"] = functools.partial(_gemm_then_flat, comm, x, w)
        for level in [1, local] if 1 < local < world else [1]:
            alternatives[f"blocks k={gar.BLOCK_CHUNKS} L={level}"] = functools.partial(
                gar.gemm_all_reduce,
                comm,
                x,
                w,
                chunks=gar.BLOCK_CHUNKS,
                schedule="blocks",
                ranks_per_host=level,
            )
    return FusedForms(
        compute=lambda: torch.matmul(x, w.t()),
        comm=lambda: gar.reference_all_reduce(comm, buf),
        unfused=lambda: gar.gemm_all_reduce_reference(comm, x, w),
        fused=lambda k: gar.gemm_all_reduce(comm, x, w, chunks=k),
        max_chunks=16,
        choose=lambda: gar.choose_chunks_for(comm, x, w, ChunkConfig(max_chunks=16)),
        alternatives=alternatives,
    )


def _gemm_then_flat(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.matmul(x, w.t())
    comm.all_reduce(out, "sum")
    return out


def _embedding_case(comm: Communicator, shape: tuple[int, ...]) -> FusedForms:
    batch, num_tables, rows, dim, pooling = shape
    world, rank, dev = comm.world_size, comm.rank, comm.device
    gen = torch.Generator().manual_seed(rank)
    local = [t for t in range(num_tables) if t % world == rank]
    per_rank = [sum(1 for t in range(num_tables) if t % world == r) for r in range(world)]
    splits = split_sizes(batch, world)
    lookup = emb.ShardedLookup(
        tables=[
            torch.randint(-3, 4, (rows, dim), generator=gen, device="cpu").float().to(dev)
            for _ in local
        ],
        # Power-law indices (DLRM's generator draws skewed ids too): popular rows are hit often.
        indices=[
            (torch.rand(batch * pooling, generator=gen, device="cpu") ** 3 * rows).long().to(dev)
            for _ in local
        ],
        offsets=[torch.arange(0, batch * pooling, pooling, device=dev) for _ in local],
        batch_splits=splits,
        tables_per_rank=per_rank,
        dim=dim,
        dtype=torch.float32,
        mode="sum",
    )
    buf = torch.zeros(batch * len(local) * dim, device=dev)
    out = torch.empty(splits[rank] * num_tables * dim, device=dev)
    in_splits = [b * len(local) * dim for b in splits]
    out_splits = [splits[rank] * t * dim for t in per_rank]
    return FusedForms(
        compute=lambda: lookup.rows(0, batch),
        comm=lambda: all_to_all(comm, out, buf, out_splits, in_splits, algo=baselines.ALL_TO_ALL),
        unfused=lambda: emb.embedding_all_to_all_reference(comm, lookup),
        fused=lambda k: emb.embedding_all_to_all(comm, lookup, chunks=k),
        by_table=lambda: emb.embedding_all_to_all(comm, lookup, chunks=BY_TABLE),
        max_chunks=4 * max(world - 1, 1),
        # The module's own choice (ShardedEmbeddingBag): the model, then a timed trial, here of
        # the forward alone (what this row times).
        choose=lambda: emb.choose_chunks_for(
            comm, lookup, config=ChunkConfig(max_chunks=4 * max(world - 1, 1)), backward=False
        ),
    )


def _make_fused_forms(comm: Communicator, op: str, shape: tuple[int, ...]) -> FusedForms:
    if op in ("all_gather_gemm", "gemm_reduce_scatter"):
        from commfuse.bench.fused_sequence import sequence_case

        return sequence_case(comm, op, shape)
    if op in ("gemm_all_to_all", "moe_step"):
        from commfuse.bench.fused_moe import gemm_all_to_all_case, moe_step_case

        return (gemm_all_to_all_case if op == "gemm_all_to_all" else moe_step_case)(comm, shape)
    if op in ("gemm_all_reduce", "gemv_all_reduce"):
        if len(shape) != 3:
            raise ValueError(f"{op} shape is (rows, in_features, out_features), got {shape}")
        return _gemm_case(comm, shape)
    if len(shape) != 5:
        raise ValueError(f"{op} shape is (batch, tables, rows, dim, pooling), got {shape}")
    return _embedding_case(comm, shape)


def _timed(comm: Communicator, fn: Callable[[], Any]) -> float:
    return timed_with_cpu(comm, fn)[0]


def timed_with_cpu(comm: Communicator, fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall us, this process's CPU us) of one call, after a barrier."""
    comm.barrier()
    cpu, start = cpu_seconds(), now(comm.device)
    fn()
    wall = (now(comm.device) - start) * 1e6
    return wall, (cpu_seconds() - cpu) * 1e6


def run_together(compute: Callable[[], Any], collective: Callable[[], Any]) -> None:
    """``collective()`` on a second thread while this one runs ``compute()``; both finish before
    it returns, and an error of either is raised here."""
    errors: list[BaseException] = []

    def communicate() -> None:
        try:
            collective()
        except BaseException as err:  # re-raised on the calling thread
            errors.append(err)

    worker = threading.Thread(target=communicate, name="bench-overlap", daemon=True)
    worker.start()
    try:
        compute()
    finally:
        worker.join()
    if errors:
        raise errors[0]


# long because: one case per pass of the loop, read top to bottom as it runs (warm-up, the
# chunk choice, the timed rounds, the bounds and the record), each part using the last's numbers.
def bench_fused_on_rank(config: FusedBenchConfig) -> list[dict[str, Any]]:
    """Runs on every rank (process group up); rank 0's return value is the report."""
    comm = Communicator()
    topology = Topology.of_rank(comm.world_size)
    reader = machine_reader(comm)
    records: list[dict[str, Any]] = []
    for op in config.ops:
        for shape in config.shapes_of(op):
            forms = _make_fused_forms(comm, op, shape)
            for _ in range(config.warmup):
                for part in (forms.compute, forms.comm, forms.unfused):
                    _timed(comm, part)
            # The chunk choice's estimates of the two parts: one call of each after the warm-up.
            compute_us, comm_us = _timed(comm, forms.compute), _timed(comm, forms.comm)
            overhead_us = measure_overhead_us(comm, repeats=5)
            agreed = torch.tensor(
                [compute_us, comm_us, overhead_us], dtype=torch.float64, device=comm.device
            )
            comm.all_reduce(agreed, "max")
            fixed = config.fixed()
            chunks: ChunkSchedule = (
                fixed
                if fixed is not None
                else (
                    forms.choose()
                    if forms.choose
                    else choose_chunks(*agreed.tolist(), max_chunks=forms.max_chunks)
                )
            )
            fused = forms.fused_at(chunks)
            if fixed is not None:  # the caller chose the schedule: time that one alone
                forms.alternatives.clear()
            for _ in range(config.warmup):
                _timed(comm, fused)
                for alternative in forms.alternatives.values():
                    _timed(comm, alternative)
            cases = {
                c.name: c
                for c in (
                    Case(name="compute", call=forms.compute),
                    Case(name="comm", call=forms.comm),
                    Case(name="unfused", call=forms.unfused),
                    Case(name="fused", call=fused),
                    Case(
                        name="overlap",
                        call=functools.partial(run_together, forms.compute, forms.comm),
                    ),
                    *(Case(name=f"fused[{n}]", call=fn) for n, fn in forms.alternatives.items()),
                    *(Case(name=f"stage:{n}", call=fn) for n, fn in forms.stages.items()),
                )
            }
            # Balanced orders, not a fixed one: with a fixed order, identical code timed as U and
            # F differed by 2-17% on the shared machine (fused k = 1 runs the unfused code).
            schedule = Schedule(
                tuple(cases),
                rounds=config.iters,
                baseline="unfused",
                control=config.control,
                seed=config.seed_order,
            )
            names = list(schedule.names)
            rounds = Rounds(comm, names, config.iters, reader)
            for i, order in enumerate(schedule.orders()):  # the same on every rank (seeded)
                for name in order:
                    rounds.time(name, i, cases[schedule.code_of(name)].call)
            measured = rounds.finish(compute="compute")
            times, network = measured.times, measured.kernel_network_us
            # The CPU floor: this rank's CPU for the computation and the communication alone
            # (medians over rounds), summed over the ranks of each machine, over its cores.
            floor = measured.cpu_floor(comm, ("compute", "comm"))
            # Each stage's own floor, for the bound's overlapped pairs (``FusedForms.bound``).
            stage_floors = {n: measured.cpu_floor(comm, (f"stage:{n}",)) for n in forms.stages}
            # The machine floor (cpu_floor.py, steps 4-6): the same CPU, plus the kernel's
            # network work of the parts alone, over the cores the ranks had.
            parts_floor = measured.floor(comm, ("compute", "comm"))
            # The unfused step does the same work in one piece: the CPU it costs (the routing,
            # the copies around the exchange) is the step's too, where the parts may miss some.
            unfused_floor = measured.floor(comm, ("unfused",))
            machine_floor = max(parts_floor, unfused_floor)
            stage_machine_floors = {n: measured.floor(comm, (f"stage:{n}",)) for n in forms.stages}
            kernel_network = {n: network[n] for n in ("compute", "comm", "unfused")} | {
                n: network[f"stage:{n}"] for n in forms.stages
            }
            wrong = torch.tensor([int((fused() != forms.unfused()).sum())], device=comm.device)
            comm.all_reduce(wrong)
            summary = summarize(
                {name: times[v].tolist() for v, name in enumerate(names)},
                baseline="unfused",
                control=schedule.control_variant,
                paired=False,  # the ratios below are of the medians
            )
            c, m, u, f, o = (
                summary.medians[name] for name in ("compute", "comm", "unfused", "fused", "overlap")
            )
            ideal = max(c, m)
            bound = dependencies = None
            # The machine's bound: no schedule beats its dependencies or its cores. Without
            # dependencies of its own, an operator's are its parts: max(C, M).
            machine_dependencies = ideal
            if forms.bound is not None:
                parts = {n: summary.medians[f"stage:{n}"] for n in forms.stages}
                medians = {"compute": c, "comm": m, **parts}
                dependencies = forms.bound(medians, stage_floors)
                bound = max(dependencies, floor)  # the CPU of the ranks alone, as before
                machine_dependencies = forms.bound(medians, stage_machine_floors)
            machine_bound = max(machine_dependencies, machine_floor)
            # The step's graph on the machine (sim/bound.py): the machine floor, each global
            # wait's idle cores and one rank's critical path, at the best chunk count; with
            # the machine's bound, two lower bounds, so their larger is one.
            graph, graph_bound = None, machine_bound
            if forms.graph is not None:
                all_cpu = measured.cpu_us
                parts_cpu = {"compute": all_cpu["compute"]} | {
                    n: all_cpu[f"stage:{n}"] for n in forms.stages
                }
                parts_wall = {"compute": c} | {
                    n: summary.medians[f"stage:{n}"] for n in forms.stages
                }
                left = measured.cores_left()
                graph = step_bound(
                    forms.graph(parts_wall, parts_cpu, floor_us=machine_floor, cores=left)
                )
                graph_bound = max(machine_bound, graph.bound_us)
            record: dict[str, Any] = {
                "op": op,
                "shape": list(shape),
                "world_size": comm.world_size,
                "hosts": topology.num_hosts,
                "ranks_per_host": topology.ranks_per_host,
                "link_mbit": topology.link_mbit,
                "emulated": config.emulated,
                "chunks": chunks,
                "compute_us": c,
                "comm_us": m,
                "unfused_us": u,
                "fused_us": f,
                "ideal_us": ideal,
                "overlap_us": o,
                # The model counts pieces of rows; a by-table schedule has none.
                "predicted_us": (
                    predict_us(c, m, chunks, float(agreed[2])) if isinstance(chunks, int) else None
                ),
                "overhead_us": float(agreed[2]),
                "fused_vs_unfused": f / u,
                "fused_vs_ideal": f / ideal,
                "fused_vs_overlap": f / o,
                "dependency_bound_us": bound,
                "dependencies_only_us": dependencies,
                "cpu_floor_us": floor,
                "stage_floors_us": stage_floors,
                "cpu_us": measured.cpu_us,
                "stages_us": {n: summary.medians[f"stage:{n}"] for n in forms.stages},
                "machine_us": measured.machine_us,
                "fused_vs_dependency_bound": f / bound if bound else None,
                "machine_floor_us": machine_floor,
                "machine_floor_parts_us": parts_floor,
                "machine_floor_unfused_us": unfused_floor,
                "machine_dependencies_us": machine_dependencies,
                "machine_bound_us": machine_bound,
                "stage_machine_floors_us": stage_machine_floors,
                "kernel_network_us": kernel_network,
                "taken_cores": measured.taken_cores,
                "fused_vs_machine_bound": f / machine_bound,
                "graph_bound_us": graph_bound if graph else None,
                "graph_bound": dataclasses.asdict(graph) if graph else None,
                "fused_vs_graph_bound": f / graph_bound if graph else None,
                **summary.as_dict(),
                "unfused_control_us": (
                    summary.medians[schedule.control_variant] if schedule.control_variant else None
                ),
                "tie": summary.is_tie(f / u, variant="fused"),
                "ratio_ci": list(summary.ratio_intervals["fused"]),
                "c_over_m": c / m if m else float("inf"),
                "wrong": int(wrong),
                "iters": config.iters,
            }
            records.append(record)
            for name, fn in forms.alternatives.items():
                # One row per other schedule: its own fused time and wrong count, the rest
                # (C, M, unfused, overlap, control) of the same rounds.
                a = summary.medians[f"fused[{name}]"]
                bad = torch.tensor([int((fn() != forms.unfused()).sum())], device=comm.device)
                comm.all_reduce(bad)
                records.append(
                    {
                        **record,
                        "op": f"{op}[{name}]",
                        "schedule_of": op,
                        "chunks": "-",  # in the name
                        "fused_us": a,
                        "predicted_us": None,
                        "fused_vs_unfused": a / u,
                        "fused_vs_ideal": a / ideal,
                        "fused_vs_overlap": a / o,
                        "fused_vs_dependency_bound": a / bound if bound else None,
                        "fused_vs_machine_bound": a / machine_bound,
                        "fused_vs_graph_bound": a / graph_bound if graph else None,
                        "tie": summary.is_tie(a / u, variant=f"fused[{name}]"),
                        "ratio_ci": list(summary.ratio_intervals[f"fused[{name}]"]),
                        "wrong": int(bad),
                    }
                )
    return records


#: The fused time over each bound (``-`` where a record has none): the ranks' CPU and the
#: dependencies (``dep``), the machine's bound, the bound of the step's graph.
BOUND_COLUMNS = (
    (
        "fused/dep",
        lambda r: (
            "-"
            if r.get("fused_vs_dependency_bound") is None
            else f"{r['fused_vs_dependency_bound']:.3f}"
        ),
    ),
    (
        "fused/bound",
        lambda r: (
            "-" if r.get("fused_vs_machine_bound") is None else f"{r['fused_vs_machine_bound']:.3f}"
        ),
    ),
    (
        "fused/graph",
        lambda r: (
            "-" if r.get("fused_vs_graph_bound") is None else f"{r['fused_vs_graph_bound']:.3f}"
        ),
    ),
)

COLUMNS = (
    ("op", lambda r: r["op"]),
    ("shape", lambda r: "x".join(map(str, r["shape"]))),
    ("P", lambda r: str(r["world_size"])),
    ("k", lambda r: str(r["chunks"])),
    ("C_us", lambda r: f"{r['compute_us']:.0f}"),
    ("M_us", lambda r: f"{r['comm_us']:.0f}"),
    ("C/M", lambda r: f"{r['c_over_m']:.2f}"),
    ("unfused_us", lambda r: f"{r['unfused_us']:.0f}"),
    ("fused_us", lambda r: f"{r['fused_us']:.0f}"),
    ("ideal_us", lambda r: f"{r['ideal_us']:.0f}"),
    ("overlap_us", lambda r: f"{r['overlap_us']:.0f}"),
    ("pred_us", lambda r: "-" if r["predicted_us"] is None else f"{r['predicted_us']:.0f}"),
    ("fused/unfused", lambda r: ratio_cell(r, "fused_vs_unfused")),
    ("U'/U", lambda r: "-" if r.get("control_ratio") is None else f"{r['control_ratio']:.3f}"),
    ("fused/ideal", lambda r: f"{r['fused_vs_ideal']:.3f}"),
    ("fused/overlap", lambda r: f"{r['fused_vs_overlap']:.3f}"),
    *BOUND_COLUMNS,
    ("wrong", lambda r: str(r["wrong"])),
)

"""``commfuse bench fused --step NAME``: a whole training step of a workload, fused against unfused.

Where a step names the parts its exchanges can overlap (``stages``, timed alone in the same
rounds as ``stage:NAME``), three bounds divide the fused step, as in the operator benchmark
(``bench/fused.py``), each the larger of what it counts and the ones before it:

1. ``fused/dep``: the **dependency-aware bound** (the unfused step less what its dependencies
   let each exchange hide; ``dlrm_step_bound_us``) and the **CPU floor** (``bench/cpu_floor.py``:
   the unfused step's CPU time, summed over the ranks that share a machine's cores, over them);
2. ``fused/bound``: the **machine floor** (``cpu_floor.machine_floor_us``, measured by
   ``bench/machine_rounds.py``): the CPU and the kernel's network work of the unfused step, or
   of its parts alone (``_StepForms.parts``), whichever is more, over the cores other programs
   left the ranks while the computation alone ran (``_StepForms.compute_stage``);
3. ``fused/graph``: the **bound of the step's graph** on those cores (``sim.bound.step_bound``;
   DLRM's is ``dlrm_step_graph``), which adds the cores its global waits leave idle.

Every record keeps each of them, and each variant's CPU time (all ranks together, ``cpu_us``).

Steps: ``dlrm`` (``workloads/dlrm.py``; shape = global batch x tables x rows x dim x pooling);
``tp-transformer`` and ``tp-transformer-sp`` (``workloads/tp_transformer.py``, Megatron tensor
parallelism without and with sequence parallelism; shape = seq x batch x d_model x heads x d_ff
x layers; the world size must divide heads).
To add one, write a ``*_case(comm, shape, chunks, *, control) -> _StepForms`` and add it to
``STEPS``.

Design notes: ``docs/benchmarking.md``, "Whole fused steps: why time a step".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from commfuse.bench.cases import Case
from commfuse.bench.fused import BOUND_COLUMNS, check_schedule
from commfuse.bench.machine_rounds import Rounds, machine_reader
from commfuse.bench.schedule import Schedule, summarize
from commfuse.bench.table import ratio_cell
from commfuse.cluster.topology import Topology
from commfuse.comm import Communicator
from commfuse.fused import embedding_all_to_all as emb
from commfuse.fused.chunking import BY_TABLE, ChunkConfig, ChunkSchedule
from commfuse.fused.table_gradients import TableGradients
from commfuse.sim.bound import GlobalWait, StepGraph, step_bound


@dataclasses.dataclass
class _StepForms:
    """One workload, built twice (three times with a control). ``fused(data)``,
    ``unfused(data)`` (and ``control(data)``) run one training step on ``prepare(step)`` (made
    outside the timed region)."""

    prepare: Callable[[int], Any]
    fused: Callable[[Any], Any]
    unfused: Callable[[Any], Any]
    control: Callable[[Any], Any] | None
    chunks: Callable[[], ChunkSchedule]
    """The number of chunks the fused model chose (valid after its first step)."""
    differing: Callable[[], int]
    """Parameter elements that differ between the fused (and the control) model and the
    unfused one."""
    extra: dict[str, float]
    """Context for the record (e.g. the exchange's compute and communication alone)."""
    stages: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    """Parts of the step timed alone in the same rounds (``stage:NAME``): the inputs of
    ``bound``."""
    bound: Callable[[dict[str, float]], float] | None = None
    """The dependency-aware bound from the medians of ``unfused`` and the stages (by name)."""
    compute_stage: str | None = None
    """The stage that is computation alone, over which the machine's own kernel rate and the
    cores other programs take are read (``machine_rounds.machine_share``); None: no machine
    floor."""
    parts: tuple[str, ...] = ()
    """The stages whose work together is the step's (a name once per time the step does it),
    for the machine floor of the parts alone."""
    graph: Callable[..., StepGraph] | None = None
    """The step's graph for ``sim.bound.step_bound`` from the stages' medians (wall) and CPU
    (all ranks), by name, given ``floor_us`` (the machine floor) and ``cores`` (those left to
    the ranks)."""


def _dlrm_case(
    comm: Communicator,
    shape: tuple[int, ...],
    chunks: ChunkSchedule | None,
    *,
    control: bool = False,
) -> _StepForms:
    from commfuse.workloads import dlrm

    batch, tables, rows, dim, pooling = shape
    if batch % comm.world_size:
        raise ValueError(f"dlrm global batch {batch} must divide by world size {comm.world_size}")
    config = dlrm.DLRMConfig(
        num_tables=tables,
        rows_per_table=rows,
        embedding_dim=dim,
        pooling=pooling,
        batch_per_rank=batch // comm.world_size,
        bottom_mlp=(128,),
        top_mlp=(128,),
    )
    variants = {ex: ex for ex in dlrm.EXCHANGES} | ({"control": "unfused"} if control else {})
    chunk_config = (
        ChunkConfig(schedule=BY_TABLE) if chunks == BY_TABLE else ChunkConfig(num_chunks=chunks)
    )
    models = {
        name: dlrm.DLRM(config, comm, exchange=ex, chunk_config=chunk_config)
        for name, ex in variants.items()
    }
    opts = {ex: dlrm.make_optimizer(m) for ex, m in models.items()}

    def step_fn(ex: str) -> Callable[[Any], float]:
        def run(data: Any) -> float:
            return dlrm.train_step(models[ex], opts[ex], data)

        return run

    def differing() -> int:
        return sum(
            int((p != q).sum())
            for other in models
            if other != "unfused"
            for p, q in zip(models[other].parameters(), models["unfused"].parameters(), strict=True)
        )

    # The exchange alone, for context: lookups (C) and gloo's All-to-All (M) of one forward.
    data = dlrm.synthetic_batch(config, 0, comm.rank, comm.world_size, device=comm.device)
    embedding = models["unfused"].embedding
    table_list = [p.detach() for p in embedding.tables]
    lookup = embedding.lookup(data.indices, data.offsets, data.batch_splits, table_list)
    emb.measure(comm, lookup)
    c_us, m_us = emb.measure(comm, lookup)
    agreed = torch.tensor([c_us, m_us], dtype=torch.float64, device=comm.device)
    comm.all_reduce(agreed, "max")
    stages = _dlrm_stages(comm, lookup) | _dlrm_dense_stages(comm, config, data)
    world = comm.world_size
    # The schedules the exchange chooses among (embedding_all_to_all.choose_chunks_for): 1, 2
    # and 3 pieces per destination, or one piece per table.
    pieces = {p * (world - 1) for p in (1, 2, 3)} | {1, max(lookup.tables_per_rank)}
    return _StepForms(
        prepare=lambda step: dlrm.synthetic_batch(
            config, step, comm.rank, comm.world_size, device=comm.device
        ),
        fused=step_fn("fused"),
        unfused=step_fn("unfused"),
        control=step_fn("control") if control else None,
        chunks=lambda: _chosen(list(models["fused"].embedding._chunks.values())),
        differing=differing,
        extra={"compute_us": float(agreed[0]), "comm_us": float(agreed[1])},
        stages=stages,
        bound=dlrm_step_bound_us,
        compute_stage="accumulate",
        parts=("lookup", "exchange", "exchange", "accumulate", "dense", "allreduce"),
        graph=functools.partial(
            dlrm_step_graph, ranks=world, chunk_choices=tuple(sorted(p for p in pieces if p))
        ),
    )


def _dlrm_stages(comm: Communicator, lookup: emb.ShardedLookup) -> dict[str, Callable[[], Any]]:
    """The parts of the DLRM step the exchange can overlap, each alone: the forward's lookups
    of the global batch, one All-to-All of the exchange's size (the unfused reference's; the
    reverse exchange moves the same bytes), and the table gradients' accumulation as the
    unfused backward does it (its zeroed buffer and expanded offsets, then table by table every
    rank's block of samples)."""
    from commfuse.collectives import all_to_all
    from commfuse.fused import baselines

    batch, rank, world = sum(lookup.batch_splits), comm.rank, comm.world_size
    splits, dim, local = lookup.batch_splits, lookup.dim, len(lookup.tables)
    send = lookup.rows(0, batch).contiguous().view(-1)
    in_splits = [b * local * dim for b in splits]
    out_splits = [splits[rank] * t * dim for t in lookup.tables_per_rank]
    recv = send.new_empty(sum(out_splits))
    grad = send.new_ones((batch, local, dim))
    order = [rank] + [(rank + s) % world for s in range(1, world)]

    def accumulate() -> None:  # as the unfused backward does (workloads/dlrm.py)
        grads = TableGradients(lookup.tables, lookup.indices, lookup.offsets, lookup.mode)
        for t in range(local):
            for src in order:
                start = lookup.sample_starts[src]
                grads.add_table(t, start, grad[start : start + splits[src], t])

    return {
        "lookup": lambda: lookup.rows(0, batch),
        "exchange": lambda: all_to_all(
            comm, recv, send, out_splits, in_splits, algo=baselines.ALL_TO_ALL
        ),
        "accumulate": accumulate,
    }


def _dlrm_dense_stages(comm: Communicator, config: Any, data: Any) -> dict[str, Callable[[], Any]]:
    """The DLRM step's data-parallel parts, each alone, on a model of their own (the step's
    shapes, so that timing them trains none of the benchmark's models): ``bottom``, the bottom
    MLP's forward (which needs no exchanged vector); ``dense``, the MLPs' and the interaction's
    forward and backward from fixed exchanged vectors and the MLPs' update; ``allreduce``, the
    sum of the MLP gradients and the loss as the step does it (one buffer)."""
    import torch.nn.functional as F

    from commfuse.workloads import dlrm

    model = dlrm.DLRM(config, comm, exchange="unfused")
    params = model.dense_parameters()
    opt = torch.optim.SGD(params, lr=config.lr)
    mine = data.batch_splits[comm.rank]
    sparse = data.dense.new_zeros(mine, config.num_tables, config.embedding_dim)
    sparse.requires_grad_(True)  # its gradient is what the reverse exchange sends
    flat = data.dense.new_zeros(sum(p.numel() for p in params) + 1)

    def dense() -> None:
        opt.zero_grad(set_to_none=False)
        logits = model.dense_forward(data, sparse)
        loss = F.binary_cross_entropy_with_logits(logits, data.labels, reduction="sum")
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    return {
        "bottom": lambda: model.bottom(data.dense),
        "dense": dense,
        "allreduce": lambda: comm.all_reduce(flat, "sum"),
    }


def dlrm_step_graph(
    medians: dict[str, float],
    cpu: dict[str, float],
    *,
    floor_us: float,
    cores: float,
    ranks: int,
    chunk_choices: tuple[int, ...],
) -> StepGraph:
    """The DLRM step's graph for ``sim.bound.step_bound``, from its parts timed alone
    (``medians``: wall us of each stage; ``cpu``: their CPU us, all ranks).

    Its global waits (every rank's next work needs every rank's data), both exchanges cut by
    the same schedule into ``k`` pieces (``chunk_choices``), the wait being one piece's round:

    * the forward exchange's last piece: no sample's interaction starts before every table's
      vector is in, from every rank; the bottom MLP's forward (``bottom``) may run meanwhile;
    * the reverse exchange's first piece: no table gradient is summed before its rows come in
      from every rank; meanwhile may run each rank's own samples' block of the accumulation
      (``accumulate`` over the ranks) and, counted whole so as to count no less than the graph
      lets run, the MLPs' work (``dense``);
    * the MLP gradients' all-reduce (``allreduce``, one piece): their update waits for it, and
      the accumulation of the table gradients (``accumulate``) may run meanwhile.

    One rank's computation is its lookups, its accumulation and its MLPs' work (``lookup``,
    ``accumulate``, ``dense``) over the ranks. Left out, as a bound may leave out work: the
    tables' update and the zeroing of their gradients, the loss, each exchange's own copies."""

    def wait(name: str, timed: str, **kw: Any) -> GlobalWait:
        return GlobalWait.alone(name, medians[timed], cpu[timed], **kw)

    return StepGraph(
        ranks=ranks,
        cores=cores,
        floor_us=floor_us,
        rank_compute_us=(cpu["lookup"] + cpu["accumulate"] + cpu["dense"]) / ranks,
        waits=(
            wait("exchange", "exchange", chunked=True, fill_us=cpu["bottom"]),
            wait(
                "exchange_back",
                "exchange",
                chunked=True,
                fill_us=cpu["accumulate"] / ranks + cpu["dense"],
            ),
            wait("allreduce", "allreduce", fill_us=cpu["accumulate"]),
        ),
        chunk_choices=chunk_choices,
    )


def dlrm_step_bound_us(medians: dict[str, float]) -> float:
    """The DLRM step's dependency-aware bound: the unfused step less what its dependencies let
    the exchanges hide, each only behind the computation it can overlap and only with
    infinitely fine pieces (so a bound, not a prediction): the forward exchange behind the
    lookups that produce it, the reverse exchange behind the accumulation of the table
    gradients it delivers. The MLPs, the feature interaction, the loss and the optimizer
    depend on one exchange or the other end to end. ``medians`` holds ``unfused``,
    ``lookup``, ``exchange`` and ``accumulate``, in any one unit."""
    x = medians["exchange"]
    return medians["unfused"] - min(x, medians["lookup"]) - min(x, medians["accumulate"])


def _chosen(chosen: list[ChunkSchedule]) -> ChunkSchedule:
    """What a model's fused modules chose, for the record: by table if any did, else the
    largest number of chunks (1: all unfused)."""
    if BY_TABLE in chosen:
        return BY_TABLE
    return max((k for k in chosen if isinstance(k, int)), default=1)


def _tp_transformer_case(
    comm: Communicator,
    shape: tuple[int, ...],
    chunks: ChunkSchedule | None,
    *,
    sequence_parallel: bool = False,
    control: bool = False,
) -> _StepForms:
    """``workloads/tp_transformer.py``; shape = seq x batch x d_model x heads x d_ff x layers.
    Fused and unfused sum in different orders (the fused pipeline by rank, gloo's ring along
    the ring), so ``differing`` counts elements apart by more than rtol 1e-4 (atol 1e-6)."""
    from commfuse.workloads import tp_transformer as tp

    assert chunks is None or isinstance(chunks, int)  # StepBenchConfig: by table is dlrm's only
    if len(shape) != 6:
        raise ValueError(
            f"tp-transformer shape is seq x batch x d_model x heads x d_ff x layers, got {shape}"
        )
    seq, batch, d_model, heads, d_ff, layers = shape
    options = tp.TPTransformerConfig(
        d_model=d_model,
        num_heads=heads,
        d_ff=d_ff,
        num_layers=layers,
        seq_len=seq,
        batch=batch,
        sequence_parallel=sequence_parallel,
    )
    workload = tp.TPTransformerWorkload(options)
    variants = {"fused": True, "unfused": False} | ({"control": False} if control else {})
    models = {
        name: workload.build_model(comm, 0, fused=fused, num_chunks=chunks)
        for name, fused in variants.items()
    }
    opts = {name: workload.make_optimizer(m) for name, m in models.items()}

    def step_fn(name: str) -> Callable[[Any], float]:
        def run(data: Any) -> float:
            return workload.train_step(comm, models[name], opts[name], data)

        return run

    def differing() -> int:
        return sum(
            int((~torch.isclose(p, q, rtol=1e-4, atol=1e-6)).sum())
            for other in models
            if other != "unfused"
            for p, q in zip(models[other].parameters(), models["unfused"].parameters(), strict=True)
        )

    return _StepForms(
        prepare=lambda step: workload.batch(
            step, comm.rank, comm.world_size, seed=0, device=comm.device
        ),
        fused=step_fn("fused"),
        unfused=step_fn("unfused"),
        control=step_fn("control") if control else None,
        chunks=models["fused"].chosen_chunks,
        differing=differing,
        extra={},
    )


#: step name -> (case builder, default shapes). DLRM's default makes the embedding exchange most
#: of the step (the regime the fused operator is for): 32 tables of dim 64, 4 ids per bag (the
#: table-gradient accumulation grows with the ids per bag, the exchange does not).
STEPS: dict[str, tuple[Callable[..., _StepForms], tuple[tuple[int, ...], ...]]] = {
    "dlrm": (_dlrm_case, ((4096, 32, 5000, 64, 4),)),
    "tp-transformer": (_tp_transformer_case, ((512, 4, 512, 8, 2048, 2),)),
    "tp-transformer-sp": (
        functools.partial(_tp_transformer_case, sequence_parallel=True),
        ((512, 4, 512, 8, 2048, 2),),
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
    """What to time."""

    steps: tuple[str, ...] = ("dlrm",)
    """Workloads, from STEPS."""
    iters: int = 7
    """Timed steps per variant; medians are reported."""
    warmup: int = 2
    """Untimed steps of each variant first (connections, allocator, the choice of chunks)."""
    chunks: int | None = None
    """Fixed number of chunks (>= 1); None lets each fused module choose."""
    schedule: Literal["by_table"] | None = None
    """``"by_table"``: the embedding exchange's by-table schedule (dlrm only) instead of
    chunks."""
    shapes: tuple[tuple[int, ...], ...] | None = None
    """Shapes instead of the defaults (5 dimensions for dlrm, 6 for tp-transformer)."""
    control: bool = False
    """Train a second unfused model beside the first (A/A): the noise floor of fused/unfused."""
    seed_order: int | None = 0
    """Seed of the rounds' balanced orders."""
    emulated: bool = False
    """Whether the ranks run on an emulated network (netlab); recorded in every row."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(
                f"unknown step {', '.join(unknown)} in steps: use one of {', '.join(STEPS)}"
            )
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")
        self.fixed()

    def fixed(self) -> ChunkSchedule | None:
        """The schedule every fused module runs with (None: each module's own choice)."""
        return check_schedule(self.chunks, self.schedule, self.steps, by_table=("dlrm",))


def _on_batch(step: Callable[[Any], Any] | None, batch: list[Any]) -> Callable[[], Any]:
    """A call that runs ``step`` on the batch ``batch[0]`` holds when it runs (each round's)."""
    assert step is not None
    return lambda: step(batch[0])


# long because: one case per pass of the loop, read top to bottom as it runs (warm-up, the
# timed rounds, the bounds and the record), each part using the last's numbers.
def bench_steps_on_rank(config: StepBenchConfig) -> list[dict[str, Any]]:
    """Runs on every rank (process group up); rank 0's return value is the report."""
    comm = Communicator()
    topology = Topology.of_rank(comm.world_size)
    reader = machine_reader(comm)
    records: list[dict[str, Any]] = []
    for name in config.steps:
        build, defaults = STEPS[name]
        for shape in config.shapes or defaults:
            forms = build(comm, tuple(shape), config.fixed(), control=config.control)
            step = 0
            for _ in range(config.warmup):
                data = forms.prepare(step)
                forms.fused(data)
                forms.unfused(data)
                if forms.control is not None:
                    forms.control(data)
                step += 1
            batch: list[Any] = [None]  # this round's data, read by every variant's call
            cases = {
                "fused": Case(name="fused", call=_on_batch(forms.fused, batch)),
                "unfused": Case(name="unfused", call=_on_batch(forms.unfused, batch)),
                **{
                    f"stage:{n}": Case(name=f"stage:{n}", call=fn) for n, fn in forms.stages.items()
                },
            }
            schedule = Schedule(
                tuple(cases),
                rounds=config.iters,
                baseline="unfused",
                control=forms.control is not None,
                seed=config.seed_order,
            )
            if forms.control is not None and schedule.control_variant is not None:
                # its own model: running U twice would train U twice per round
                twin = schedule.control_variant
                cases[twin] = Case(name=twin, call=_on_batch(forms.control, batch))
            names = list(schedule.names)
            rounds = Rounds(comm, names, config.iters, reader)
            for i, order in enumerate(schedule.orders()):  # the same on every rank (seeded)
                batch[0] = forms.prepare(step)
                for variant in order:
                    rounds.time(variant, i, cases[variant].call)
                step += 1
            compute = forms.compute_stage
            measured = rounds.finish(None if compute is None else f"stage:{compute}")
            times = measured.times
            # The unfused step's CPU (this rank's median), summed over the ranks of each
            # machine, over its cores: the work any schedule of the step has to get done.
            floor = measured.cpu_floor(comm, ("unfused",))
            # The machine floor (cpu_floor.py, steps 4-6), as the operator benchmark's: the CPU
            # and the kernel's network work of the unfused step, and of the parts alone, over
            # the cores the ranks had while the computation alone ran.
            parts_floor = unfused_floor = machine_floor = None
            if compute is not None:
                unfused_floor = measured.floor(comm, ("unfused",))
                parts = [f"stage:{n}" for n in forms.parts]
                parts_floor = measured.floor(comm, parts) if parts else None
                machine_floor = max(unfused_floor, parts_floor or 0.0)
            wrong = torch.tensor([forms.differing()], device=comm.device)
            comm.all_reduce(wrong)
            summary = summarize(
                {variant: times[v].tolist() for v, variant in enumerate(names)},
                baseline="unfused",
                control=schedule.control_variant,
                paired=False,
            )
            f, u = summary.medians["fused"], summary.medians["unfused"]
            stages = {n: summary.medians[f"stage:{n}"] for n in forms.stages}
            bound = dependencies = machine_bound = graph = graph_bound = None
            if forms.bound is not None:
                dependencies = forms.bound({"unfused": u, **stages})
                bound = max(dependencies, floor)  # neither its dependencies nor its cores
            if machine_floor is not None:
                machine_bound = max(dependencies or 0.0, machine_floor)
            if forms.graph is not None and machine_floor is not None and machine_bound:
                # The step's graph on the machine (sim/bound.py): the machine floor, each
                # global wait's idle cores and one rank's critical path, at the best chunk
                # count; with the machine's bound, two lower bounds, so their larger is one.
                stage_cpu = {n: measured.cpu_us[f"stage:{n}"] for n in forms.stages}
                graph = step_bound(
                    forms.graph(
                        stages, stage_cpu, floor_us=machine_floor, cores=measured.cores_left()
                    )
                )
                graph_bound = max(machine_bound, graph.bound_us)
            records.append(
                {
                    "op": f"{name}_step",
                    "shape": list(shape),
                    "world_size": comm.world_size,
                    "hosts": topology.num_hosts,
                    "ranks_per_host": topology.ranks_per_host,
                    "link_mbit": topology.link_mbit,
                    "emulated": config.emulated,
                    "chunks": forms.chunks(),
                    **forms.extra,
                    "unfused_us": u,
                    "fused_us": f,
                    "fused_vs_unfused": f / u,
                    "dependency_bound_us": bound,
                    "dependencies_only_us": dependencies,
                    "cpu_floor_us": floor,
                    "cpu_us": measured.cpu_us,
                    "stages_us": stages,
                    "fused_vs_dependency_bound": f / bound if bound else None,
                    "machine_floor_us": machine_floor,
                    "machine_floor_parts_us": parts_floor,
                    "machine_floor_unfused_us": unfused_floor,
                    "machine_bound_us": machine_bound,
                    "kernel_network_us": measured.kernel_network_us,
                    "taken_cores": measured.taken_cores,
                    "machine_us": measured.machine_us,
                    "fused_vs_machine_bound": f / machine_bound if machine_bound else None,
                    "graph_bound_us": graph_bound,
                    "graph_bound": dataclasses.asdict(graph) if graph else None,
                    "fused_vs_graph_bound": f / graph_bound if graph_bound else None,
                    **summary.as_dict(),
                    "tie": summary.is_tie(f / u, variant="fused"),
                    "ratio_ci": list(summary.ratio_intervals["fused"]),
                    "wrong": int(wrong),
                    "iters": config.iters,
                }
            )
    return records


COLUMNS = (
    ("step", lambda r: r["op"]),
    ("shape", lambda r: "x".join(map(str, r["shape"]))),
    ("P", lambda r: str(r["world_size"])),
    ("k", lambda r: str(r["chunks"])),
    ("exch_C_us", lambda r: f"{r['compute_us']:.0f}" if "compute_us" in r else "-"),
    ("exch_M_us", lambda r: f"{r['comm_us']:.0f}" if "comm_us" in r else "-"),
    ("unfused_us", lambda r: f"{r['unfused_us']:.0f}"),
    ("fused_us", lambda r: f"{r['fused_us']:.0f}"),
    ("fused/unfused", lambda r: ratio_cell(r, "fused_vs_unfused")),
    ("U'/U", lambda r: "-" if r.get("control_ratio") is None else f"{r['control_ratio']:.3f}"),
    (
        "dep_us",
        lambda r: (
            "-" if r.get("dependency_bound_us") is None else f"{r['dependency_bound_us']:.0f}"
        ),
    ),
    *BOUND_COLUMNS,
    ("wrong", lambda r: str(r["wrong"])),
)

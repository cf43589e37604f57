"""``commfuse bench fused --step NAME``: a whole training step of a workload, fused against unfused.

The operator benchmark (``bench/fused.py``) times one operator; this one times what a user
sees: a full step (forward, backward, gradient allreduce, optimizer) of a model built twice
from the same seed, once with the fused operators and once with the unfused references, run
interleaved (fused, unfused, unfused, fused, ...: the order alternates so neither always runs
on a warmer machine) on the same batches, after a barrier each. A run's time is the slowest
rank's; a row reports medians and fused/unfused. Both models must end with identical
parameters (``wrong`` counts the elements that differ, summed over ranks).

Steps: ``dlrm`` (``workloads/dlrm.py``; shape = global batch x tables x rows x dim x pooling);
``tp-transformer`` and ``tp-transformer-sp`` (``workloads/tp_transformer.py``, Megatron tensor
parallelism without and with sequence parallelism; shape = seq x batch x d_model x heads x d_ff
x layers; the world size must divide heads).
To add one, write a ``*_case(comm, shape, chunks) -> StepCase`` and add it to ``STEPS``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from commfuse.bench.fused import check_chunks
from commfuse.cluster.topology import Topology
from commfuse.comm import Communicator
from commfuse.fused import embedding_alltoall as emb
from commfuse.fused.chunking import ChunkConfig


@dataclasses.dataclass
class StepCase:
    """One workload, built twice. ``fused(data)`` and ``unfused(data)`` run one training step
    on ``prepare(step)`` (made outside the timed region)."""

    prepare: Callable[[int], Any]
    fused: Callable[[Any], Any]
    unfused: Callable[[Any], Any]
    chunks: Callable[[], int]
    """The number of chunks the fused model chose (valid after its first step)."""
    differing: Callable[[], int]
    """Parameter elements that differ between the two models."""
    extra: dict[str, float]
    """Context for the record (e.g. the exchange's compute and communication alone)."""


def dlrm_case(comm: Communicator, shape: tuple[int, ...], chunks: int | None) -> StepCase:
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
    models = {
        ex: dlrm.DLRM(config, comm, exchange=ex, chunk_config=ChunkConfig(num_chunks=chunks))
        for ex in dlrm.EXCHANGES
    }
    opts = {ex: dlrm.make_optimizer(m) for ex, m in models.items()}

    def step_fn(ex: str) -> Callable[[Any], float]:
        def run(data: Any) -> float:
            return dlrm.train_step(models[ex], opts[ex], data)

        return run

    def differing() -> int:
        pairs = zip(models["fused"].parameters(), models["unfused"].parameters(), strict=True)
        return sum(int((p != q).sum()) for p, q in pairs)

    # The exchange alone, for context: lookups (C) and gloo's All-to-All (M) of one forward.
    data = dlrm.synthetic_batch(config, 0, comm.rank, comm.world_size)
    embedding = models["unfused"].embedding
    table_list = [p.detach() for p in embedding.tables]
    lookup = embedding.lookup(data.indices, data.offsets, data.batch_splits, table_list)
    emb.measure(comm, lookup)
    c_us, m_us = emb.measure(comm, lookup)
    agreed = torch.tensor([c_us, m_us], dtype=torch.float64)
    comm.all_reduce(agreed, "max")
    return StepCase(
        prepare=lambda step: dlrm.synthetic_batch(config, step, comm.rank, comm.world_size),
        fused=step_fn("fused"),
        unfused=step_fn("unfused"),
        chunks=lambda: max(models["fused"].embedding._chunks.values(), default=1),
        differing=differing,
        extra={"compute_us": float(agreed[0]), "comm_us": float(agreed[1])},
    )


def tp_transformer_case(
    comm: Communicator,
    shape: tuple[int, ...],
    chunks: int | None,
    *,
    sequence_parallel: bool = False,
) -> StepCase:
    """``workloads/tp_transformer.py``; shape = seq x batch x d_model x heads x d_ff x layers.
    Fused and unfused sum in different orders (the fused pipeline by rank, gloo's ring along
    the ring), so ``differing`` counts elements apart by more than rtol 1e-4 (atol 1e-6)."""
    from commfuse.workloads import tp_transformer as tp

    if len(shape) != 6:
        raise ValueError(
            f"tp-transformer shape is seq x batch x d_model x heads x d_ff x layers, got {shape}"
        )
    seq, batch, d_model, heads, d_ff, layers = shape
    options = tp.TPTransformerOptions(
        d_model=d_model,
        num_heads=heads,
        d_ff=d_ff,
        num_layers=layers,
        seq_len=seq,
        batch=batch,
        sequence_parallel=sequence_parallel,
    )
    workload = tp.TPTransformerWorkload(options)
    models = {
        fused: workload.build_model(comm, 0, fused=fused, num_chunks=chunks)
        for fused in (True, False)
    }
    opts = {fused: workload.make_optimizer(m) for fused, m in models.items()}

    def step_fn(fused: bool) -> Callable[[Any], float]:
        def run(data: Any) -> float:
            return workload.train_step(comm, models[fused], opts[fused], data)

        return run

    def differing() -> int:
        pairs = zip(models[True].parameters(), models[False].parameters(), strict=True)
        return sum(int((~torch.isclose(p, q, rtol=1e-4, atol=1e-6)).sum()) for p, q in pairs)

    return StepCase(
        prepare=lambda step: workload.batch(step, comm.rank, comm.world_size, seed=0),
        fused=step_fn(True),
        unfused=step_fn(False),
        chunks=models[True].chosen_chunks,
        differing=differing,
        extra={},
    )


#: step name -> (case builder, default shapes). DLRM's default makes the embedding exchange most
#: of the step (the regime the fused operator is for): 32 tables of dim 64, 4 ids per bag (the
#: table-gradient accumulation grows with the ids per bag, the exchange does not).
STEPS: dict[str, tuple[Callable[..., StepCase], tuple[tuple[int, ...], ...]]] = {
    "dlrm": (dlrm_case, ((4096, 32, 5000, 64, 4),)),
    "tp-transformer": (tp_transformer_case, ((512, 4, 512, 8, 2048, 2),)),
    "tp-transformer-sp": (
        functools.partial(tp_transformer_case, sequence_parallel=True),
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
    """Fixed number of chunks (0: the embedding exchange by table, dlrm only); None lets each
    fused module choose."""
    shapes: tuple[tuple[int, ...], ...] | None = None
    """Shapes instead of the defaults (5 dimensions for dlrm, 6 for tp-transformer)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"unknown --step {', '.join(unknown)}: use one of {', '.join(STEPS)}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        check_chunks(self.chunks, self.steps, by_table=("dlrm",))


def _timed(comm: Communicator, fn: Callable[[Any], Any], data: Any) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn(data)
    return (time.perf_counter() - start) * 1e6


def bench_steps_on_rank(config: StepBenchConfig) -> list[dict[str, Any]]:
    """Runs on every rank (process group up); rank 0's return value is the report."""
    comm = Communicator()
    topology = Topology.from_env()
    records: list[dict[str, Any]] = []
    for name in config.steps:
        build, defaults = STEPS[name]
        for shape in config.shapes or defaults:
            case = build(comm, tuple(shape), config.chunks)
            step = 0
            for _ in range(config.warmup):
                data = case.prepare(step)
                case.fused(data)
                case.unfused(data)
                step += 1
            times = torch.zeros(2, config.iters, dtype=torch.float64)
            for i in range(config.iters):
                order = (0, 1) if i % 2 == 0 else (1, 0)
                data = case.prepare(step)
                for v in order:
                    times[v, i] = _timed(comm, case.fused if v == 0 else case.unfused, data)
                step += 1
            comm.all_reduce(times, "max")
            wrong = torch.tensor([case.differing()])
            comm.all_reduce(wrong)
            f, u = (statistics.median(row.tolist()) for row in times)
            records.append(
                {
                    "op": f"{name}_step",
                    "shape": list(shape),
                    "world_size": comm.world_size,
                    "hosts": topology.num_hosts,
                    "ranks_per_host": topology.ranks_per_host,
                    "link_mbit": topology.link_mbit,
                    "emulated": bool(os.environ.get("COMMFUSE_NETLAB")),
                    "chunks": case.chunks(),
                    **case.extra,
                    "unfused_us": u,
                    "fused_us": f,
                    "fused_vs_unfused": f / u,
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
    ("fused/unfused", lambda r: f"{r['fused_vs_unfused']:.3f}"),
    ("wrong", lambda r: str(r["wrong"])),
)

"""AllGather + GEMM and GEMM + ReduceScatter (sequence parallelism): the fused rings and the
unfused references equal the single-process product, forward and backward (through
torch.ops.commfuse.*), for world sizes 1-5, equal and uneven sequence shards (an empty shard
included), uneven feature shards (an empty one at P = 5), float32 and bfloat16 (integer-valued
inputs: every sum is exact in both); each ring sends exactly a ring collective's bytes (the
reference's ring algorithm's, when shards are equal) and its backward the mirror collective's;
the modules match a single-process linear; bad input raises a clear ValueError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.fused import ChunkConfig
from commfuse.fused import all_gather_gemm as agg
from commfuse.fused import gemm_reduce_scatter as grs
from commfuse.fused.chunking import split_sizes
from commfuse.fused.linear import ColumnParallelLinear, RowParallelLinear
from commfuse.fused.ops import all_gather_gemm_op, gemm_reduce_scatter_op
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]


def ints(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def seq_splits(world: int, uneven: bool) -> list[int]:
    if not uneven:
        return [2] * world
    return {1: [3], 2: [3, 1]}.get(world, [3, 0, 1, 2, 4][:world])


def shard(total: int, world: int, rank: int) -> slice:
    sizes = split_sizes(total, world)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def grid() -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    k_in, n_out = 6, 5
    for dtype in (torch.float32, torch.bfloat16):
        es = torch.tensor([], dtype=dtype).element_size()
        for uneven in (False, True):
            splits = seq_splits(world, uneven)
            s_total, starts = sum(splits), [sum(splits[:j]) for j in range(world)]
            mine = slice(starts[rank], starts[rank] + splits[rank])
            full_x = ints((s_total, k_in), 1, dtype)
            full_w = ints((n_out, k_in), 2, dtype)
            grad = ints((s_total, n_out), 3, dtype)
            for chunks in (1, 2):
                where = f"rank {rank}/{world} {dtype} splits={splits} chunks={chunks}"
                # AllGather + GEMM: column-parallel (output features sharded).
                cols = shard(n_out, world, rank)
                x = full_x[mine].clone().requires_grad_(True)
                w = full_w[cols].clone().requires_grad_(True)
                comm.stats.reset()
                y, gathered = all_gather_gemm_op(x, w, splits, comm.key, chunks, "auto")
                fwd = comm.stats[agg.LABEL]
                if not torch.equal(y, full_x @ full_w[cols].t()) or not torch.equal(
                    gathered, full_x
                ):
                    failures.append(f"{where}: all_gather_gemm forward differs")
                comm.stats.reset()
                (y * grad[:, cols]).sum().backward()
                bwd = comm.stats[grs.LABEL]
                want_gx = (grad.float() @ full_w.float()).to(dtype)[mine]  # summed over ranks
                want_gw = grad[:, cols].t() @ full_x
                if x.grad is None or not torch.equal(x.grad, want_gx):
                    failures.append(f"{where}: all_gather_gemm grad_x differs")
                if w.grad is None or not torch.equal(w.grad, want_gw):
                    failures.append(f"{where}: all_gather_gemm grad_w differs")
                if chunks > 1 and world > 1:
                    right = (rank + 1) % world
                    want = sum(n for j, n in enumerate(splits) if j != right) * k_in * es
                    msgs = sum(1 for j, n in enumerate(splits) if j != right and n)
                    if (fwd.bytes_sent, fwd.messages_sent) != (want, msgs):
                        failures.append(
                            f"{where}: AG sent {fwd.bytes_sent}B/{fwd.messages_sent}, want {want}/{msgs}"
                        )
                    want_rs = sum(n for j, n in enumerate(splits) if j != rank) * k_in * es
                    if bwd.bytes_sent != want_rs:
                        failures.append(
                            f"{where}: AG backward sent {bwd.bytes_sent}, want {want_rs}"
                        )
                    if not uneven:  # equal shards: exactly the ring allgather's bytes
                        comm.stats.reset()
                        agg.all_gather_gemm_reference(
                            comm, x.detach(), w.detach(), splits=splits, algo="ring"
                        )
                        ring = comm.stats[label("all_gather", "ring")].bytes_sent
                        if ring != fwd.bytes_sent:
                            failures.append(
                                f"{where}: AG sent {fwd.bytes_sent}, ring reference {ring}"
                            )
                # GEMM + ReduceScatter: row-parallel (input features sharded, 4 of them: an
                # empty shard at P = 5).
                kin = shard(4, world, rank)
                full_a = ints((s_total, 4), 4, dtype)
                full_v = ints((n_out, 4), 5, dtype)
                a = full_a[:, kin].clone().requires_grad_(True)
                v = full_v[:, kin].clone().requires_grad_(True)
                comm.stats.reset()
                z = gemm_reduce_scatter_op(a, v, splits, comm.key, chunks, "auto")
                fwd = comm.stats[grs.LABEL]
                if not torch.equal(z, (full_a @ full_v.t())[mine]):
                    failures.append(f"{where}: gemm_reduce_scatter forward differs")
                ref = grs.gemm_reduce_scatter_reference(comm, a.detach(), v.detach(), splits=splits)
                if not torch.equal(ref, z.detach()):
                    failures.append(f"{where}: fused differs from the unfused reference")
                comm.stats.reset()
                (z * grad[mine]).sum().backward()
                bwd = comm.stats[agg.LABEL]
                if a.grad is None or not torch.equal(a.grad, grad @ full_v[:, kin]):
                    failures.append(f"{where}: gemm_reduce_scatter grad_a differs")
                if v.grad is None or not torch.equal(v.grad, grad.t() @ full_a[:, kin]):
                    failures.append(f"{where}: gemm_reduce_scatter grad_w differs")
                if chunks > 1 and world > 1:
                    want = sum(n for j, n in enumerate(splits) if j != rank) * n_out * es
                    if fwd.bytes_sent != want:
                        failures.append(f"{where}: RS sent {fwd.bytes_sent}, want {want}")
                    right = (rank + 1) % world
                    want_ag = sum(n for j, n in enumerate(splits) if j != right) * n_out * es
                    if bwd.bytes_sent != want_ag:
                        failures.append(
                            f"{where}: RS backward sent {bwd.bytes_sent}, want {want_ag}"
                        )
                    if not uneven:
                        comm.stats.reset()
                        grs.gemm_reduce_scatter_reference(
                            comm, a.detach(), v.detach(), splits=splits, algo="ring"
                        )
                        ring = comm.stats[label("reduce_scatter", "ring")].bytes_sent
                        if ring != fwd.bytes_sent:
                            failures.append(
                                f"{where}: RS sent {fwd.bytes_sent}, ring reference {ring}"
                            )
    return failures


def modules() -> list[str]:
    """Column then row layer over [S_r, batch=2, hidden] against one process's nn.Linear pair."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    for config in (ChunkConfig(num_chunks=2), ChunkConfig()):
        col = ColumnParallelLinear(6, 7, comm, sequence_parallel=True, chunk_config=config, seed=1)
        row = RowParallelLinear(7, 6, comm, sequence_parallel=True, chunk_config=config, seed=2)
        ref1, ref2 = torch.nn.Linear(6, 7), torch.nn.Linear(7, 6)
        with torch.no_grad():
            for ref, mod, seed in ((ref1, col, 1), (ref2, row, 2)):
                full_w = ints(tuple(ref.weight.shape), 10 + seed, torch.float32)
                full_b = ints(tuple(ref.bias.shape), 20 + seed, torch.float32)
                ref.weight.copy_(full_w)
                ref.bias.copy_(full_b)
                if isinstance(mod, ColumnParallelLinear):
                    mod.weight.copy_(full_w[slice(*mod.out_range)])
                    assert mod.bias is not None
                    mod.bias.copy_(full_b[slice(*mod.out_range)])
                else:
                    mod.weight.copy_(full_w[:, slice(*mod.in_range)])
                    assert mod.bias is not None
                    mod.bias.copy_(full_b)
        splits = split_sizes(3 * world + 1, world)
        full = ints((sum(splits), 2, 6), 30, torch.float32)
        mine = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
        x = full[mine].clone().requires_grad_(True)
        out = row(col(x, splits), splits)
        truth_x = full.clone().requires_grad_(True)
        truth = ref2(ref1(truth_x))
        where = f"rank {rank}/{world} {config}"
        if out.shape != truth[mine].shape or not torch.equal(out, truth[mine]):
            failures.append(f"{where}: modules differ from nn.Linear")
        out.sum().backward()
        truth.sum().backward()  # every rank's rows: the weights see all of them
        assert truth_x.grad is not None
        assert ref1.weight.grad is not None and ref2.weight.grad is not None
        if x.grad is None or not torch.equal(x.grad, truth_x.grad[mine]):
            failures.append(f"{where}: input gradient differs")
        if col.weight.grad is None or not torch.equal(
            col.weight.grad, ref1.weight.grad[slice(*col.out_range)]
        ):
            failures.append(f"{where}: column weight gradient differs")
        if row.weight.grad is None or not torch.equal(
            row.weight.grad, ref2.weight.grad[:, slice(*row.in_range)]
        ):
            failures.append(f"{where}: row weight gradient differs")
    return failures


def errors() -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    x, w = torch.ones(2, 3), torch.ones(4, 3)
    checks: dict[str, Callable[[], object]] = {
        "splits needs": lambda: agg.all_gather_gemm(comm, x, w, splits=[2] * (world + 1)),
        "has 2 rows but splits": lambda: agg.all_gather_gemm(comm, x, w, splits=[1] * world),
        "need x [rows, K]": lambda: grs.gemm_reduce_scatter(comm, x, torch.ones(4, 2)),
        "cast one of them": lambda: agg.all_gather_gemm(comm, x, w.double()),
        "chunks must be >= 1": lambda: grs.gemm_reduce_scatter(comm, x, w, chunks=0),
    }
    for needle, call in checks.items():
        try:
            call()
            failures.append(f"rank {rank}: no error for {needle!r}")
        except ValueError as err:
            if needle not in str(err):
                failures.append(f"rank {rank}: unclear error {err}")
    # Ranks disagreeing on the hidden size: every rank raises, naming each rank's shape.
    col = ColumnParallelLinear(3 + rank % 2, 4, comm, sequence_parallel=True)
    try:
        col(torch.ones(2, 3 + rank % 2))
        if world > 1:
            failures.append(f"rank {rank}: mismatched hidden sizes went through")
    except ValueError as err:
        if "ranks passed different tensors" not in str(err):
            failures.append(f"rank {rank}: unclear error {err}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sequence_parallel_ops(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(grid, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.parametrize("world", [1, 3])
def test_sequence_parallel_modules(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(modules, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.parametrize("world", [1, 2])
def test_sequence_parallel_errors(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(errors, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])


def test_bench_records(pool: PoolFn) -> None:
    from commfuse.bench.fused import FusedBenchConfig, bench_fused_on_rank

    ops = ("all_gather_gemm", "gemm_reduce_scatter")
    config = FusedBenchConfig(ops=ops, iters=1, warmup=1, shapes=((9, 8, 6),))
    records = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert [r["op"] for r in records] == list(ops)
    for r in records:
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["chunks"] in (1, 2)
        assert r["ideal_us"] == max(r["compute_us"], r["comm_us"])


def opchecks() -> dict[str, str]:
    """``torch.library.opcheck`` (schema, fake kernel, autograd registration, AOT dispatch) of
    the tensor-parallel operators on every rank of a real group, ring and unfused."""
    comm = Communicator()
    world = comm.world_size
    results = {}
    x = ints((3, 4), 1, torch.float32).requires_grad_(True)
    w = ints((5, 4), 2, torch.float32).requires_grad_(True)
    a = ints((3 * world, 4), 3, torch.float32).requires_grad_(True)
    cases: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "gemm_all_reduce": (torch.ops.commfuse.gemm_all_reduce.default, (x, w, comm.key, 2))
    }
    for chunks in (1, 2):
        cases[f"all_gather_gemm chunks={chunks}"] = (
            torch.ops.commfuse.all_gather_gemm.default,
            (x, w, [3] * world, comm.key, chunks, "auto"),
        )
        cases[f"gemm_reduce_scatter chunks={chunks}"] = (
            torch.ops.commfuse.gemm_reduce_scatter.default,
            (a, w, [3] * world, comm.key, chunks, "auto"),
        )
    for name, (op, args) in cases.items():
        try:
            torch.library.opcheck(op, args)
            results[name] = "ok"
        except Exception as err:  # reported by name, with opcheck's reason
            results[name] = str(err).splitlines()[0]
    return results


@pytest.mark.slow
def test_tensor_parallel_operators_pass_opcheck(pool: PoolFn) -> None:
    """A backward that ran its ring as Python would trace the process group into the graph,
    which AOT dispatch cannot copy: each ring's backward is the other ring's operator."""
    for results in pool(2).run(opchecks, timeout_s=120):
        assert set(results.values()) == {"ok"}, results


def reference_algo_errors() -> list[str]:
    comm = Communicator()
    messages = []
    native = ChunkConfig(reference_algo="native")
    for build in (
        lambda: RowParallelLinear(4, 4, comm, chunk_config=native),
        lambda: ColumnParallelLinear(4, 4, comm, chunk_config=native),
    ):
        try:
            build()
        except ValueError as err:
            messages.append(str(err))
    for algo in ("native", "ring"):
        config = ChunkConfig(num_chunks=1, reference_algo=algo)
        layer = RowParallelLinear(4, 2, comm, sequence_parallel=True, chunk_config=config)
        comm.stats.reset()
        layer(torch.ones(2 * comm.world_size, 4 // comm.world_size))
        messages.append(" ".join(sorted(comm.stats.snapshot())))
    return messages


def test_reference_algo_is_for_the_sequence_parallel_references(pool: PoolFn) -> None:
    messages = pool(2).run(reference_algo_errors)[0]
    assert len(messages) == 4, messages
    for message in messages[:2]:
        assert "reference_algo='native' is for the sequence-parallel linears" in message
    # The unfused reference's ReduceScatter runs the algorithm the config names.
    assert messages[2:] == ["reduce_scatter", label("reduce_scatter", "ring")], messages

"""GEMM/GEMV + AllReduce (row-parallel linear): the fused operator equals the unfused reference
and a single-process linear exactly (integer-valued inputs), forward and backward, for world
sizes 1-5, uneven and empty shards, row groups (ring) and column chunking, float32 and bfloat16;
each rank sends exactly 2 (P-1)/P of each piece and all ranks together send what a ring allreduce of the unfused
output sends; mismatched shapes across ranks raise ValueError."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from commfuse.collectives import all_reduce
from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.fused import ChunkConfig, RowParallelLinear
from commfuse.fused.chunking import split_ranges, split_sizes
from commfuse.fused.gemm_all_reduce import (
    CROSS_LABEL,
    LABEL,
    check_shapes,
    gemm_all_reduce,
    gemm_all_reduce_reference,
    sent_bytes,
)
from commfuse.fused.two_level_all_reduce import sent_bytes as two_level_sent_bytes
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]


def full_inputs(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same small integers on every rank (sums stay exact in bfloat16 too)."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features * 10 + out_features)
    x = torch.randint(-2, 3, (rows, in_features), generator=gen).to(dtype)
    w = torch.randint(-2, 3, (out_features, in_features), generator=gen).to(dtype)
    return x, w


def my_columns(comm: Communicator, in_features: int) -> slice:
    sizes = split_sizes(in_features, comm.world_size)
    start = sum(sizes[: comm.rank])
    return slice(start, start + sizes[comm.rank])


def forward_grid() -> list[str]:
    comm = Communicator()
    failures: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        # in_features=3 on 4-5 ranks leaves some ranks an empty shard; rows=1 is a GEMV.
        for rows, in_f, out_f in ((7, 11, 5), (1, 9, 6), (13, 3, 4), (2, 5, 1)):
            x, w = full_inputs(rows, in_f, out_f, dtype)
            want = (x.float() @ w.float().t()).to(dtype)
            cols = my_columns(comm, in_f)
            xs, ws = x[:, cols].contiguous(), w[:, cols].contiguous()
            ref = gemm_all_reduce_reference(comm, xs, ws)
            # What a ring allreduce of the unfused output sends, summed over ranks.
            comm.stats.reset()
            all_reduce(comm, (xs @ ws.t()).contiguous(), algo="ring")
            ring_total = torch.tensor([comm.stats[label("all_reduce", "ring")].bytes_sent])
            comm.all_reduce(ring_total)
            for chunks in (1, 2, 3, 4, 8):  # 8: several ring groups where rows allow
                where = (
                    f"rank {comm.rank} {dtype} rows={rows} in={in_f} out={out_f} chunks={chunks}"
                )
                comm.stats.reset()
                got = gemm_all_reduce(comm, xs, ws, chunks=chunks)
                c = comm.stats[LABEL]
                if not (torch.equal(got, want) and torch.equal(got, ref)):
                    failures.append(f"{where}: wrong result {got.tolist()} want {want.tolist()}")
                if chunks == 1 or comm.world_size == 1:
                    continue  # the unfused path itself
                want_sent = sent_bytes(
                    rows, out_f, chunks, comm.world_size, comm.rank, got.element_size()
                )
                if c.bytes_sent != want_sent:
                    failures.append(f"{where}: sent {c.bytes_sent} bytes, formula {want_sent}")
                total = torch.tensor([c.bytes_sent])
                comm.all_reduce(total)
                if int(total) != int(ring_total):
                    failures.append(
                        f"{where}: ranks sent {int(total)}, ring all_reduce {int(ring_total)}"
                    )
    # 3-D input (batch, tokens, features) keeps its leading shape.
    x, w = full_inputs(6, 7, 3, torch.float32)
    cols = my_columns(comm, 7)
    got = gemm_all_reduce(comm, x[:, cols].reshape(2, 3, -1), w[:, cols].contiguous(), chunks=4)
    if not torch.equal(got, (x @ w.t()).reshape(2, 3, 3)):
        failures.append(f"rank {comm.rank}: 3-D input wrong")
    return failures


def blocks_grid() -> list[str]:
    """The row-block schedule on every host layout of the group (one rank per host, two levels,
    one host): bitwise against the dense product, bytes per rank against the formula, and in
    two levels the cross-host bytes against ``2 ((H - 1) / H) n / L``."""
    comm = Communicator()
    world, failures = comm.world_size, []
    for local in [d for d in range(1, world + 1) if world % d == 0]:
        hosts = world // local
        for dtype in (torch.float32, torch.bfloat16):
            for rows, in_f, out_f in ((world, 7, 3), (33, 6, 8)):
                x, w = full_inputs(rows, in_f, out_f, dtype)
                want = (x.float() @ w.float().t()).to(dtype)
                cols = my_columns(comm, in_f)
                xs, ws = x[:, cols].contiguous(), w[:, cols].contiguous()
                for chunks in (2, 5):
                    where = f"rank {comm.rank} L={local} {dtype} rows={rows} chunks={chunks}"
                    comm.stats.reset()
                    got = gemm_all_reduce(
                        comm, xs, ws, chunks=chunks, schedule="blocks", ranks_per_host=local
                    )
                    if not torch.equal(got, want):
                        failures.append(f"{where}: wrong result")
                    size = got.element_size()
                    formula = sent_bytes(
                        rows, out_f, chunks, world, comm.rank, size,
                        schedule="blocks", ranks_per_host=local,
                    )  # fmt: skip
                    if comm.stats[LABEL].bytes_sent != formula:
                        failures.append(
                            f"{where}: sent {comm.stats[LABEL].bytes_sent}, formula {formula}"
                        )
                    numels = [(b - a) * out_f for a, b in split_ranges(rows, chunks)]
                    across = two_level_sent_bytes(numels, hosts, local, comm.rank, size)[1]
                    if 1 < local < world and comm.stats[CROSS_LABEL].bytes_sent != across:
                        failures.append(
                            f"{where}: across hosts {comm.stats[CROSS_LABEL].bytes_sent}, "
                            f"formula {across}"
                        )
    return failures


def backward_grid(num_chunks: int | None) -> list[str]:
    """RowParallelLinear (torch.ops.commfuse.gemm_allreduce + autograd) against nn.Linear."""
    comm = Communicator()
    failures: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, in_f, out_f in ((9, 10, 4), (1, 4, 7)):
            layer = RowParallelLinear(
                in_f, out_f, comm, dtype=dtype, chunk_config=ChunkConfig(num_chunks=num_chunks)
            )
            x, w = full_inputs(rows, in_f, out_f, dtype)
            g = torch.randint(-2, 3, (rows, out_f), generator=torch.Generator().manual_seed(7)).to(
                dtype
            )
            cols = my_columns(comm, in_f)
            with torch.no_grad():
                layer.weight.copy_(w[:, cols])
                assert layer.bias is not None
                layer.bias.copy_(torch.arange(out_f).to(dtype))
            full = torch.nn.Linear(in_f, out_f, dtype=dtype)
            with torch.no_grad():
                full.weight.copy_(w)
                full.bias.copy_(torch.arange(out_f).to(dtype))
            xs = x[:, cols].clone().requires_grad_(True)
            xf = x.clone().requires_grad_(True)
            y = layer(xs)
            (y * g).sum().backward()
            yf = full(xf)
            (yf * g).sum().backward()
            where = f"rank {comm.rank} {dtype} rows={rows} chunks={num_chunks}"
            assert layer.weight.grad is not None and full.weight.grad is not None
            assert xs.grad is not None and xf.grad is not None and layer.bias.grad is not None
            checks = {
                "output": (y, yf),
                "grad_x": (xs.grad, xf.grad[:, cols]),
                "grad_w": (layer.weight.grad, full.weight.grad[:, cols]),
                "grad_b": (layer.bias.grad, full.bias.grad),
            }
            for name, (a, b) in checks.items():
                if not torch.equal(a, b):
                    failures.append(f"{where}: {name} differs")
    return failures


def auto_choice() -> tuple[int, list[str]]:
    """The measured choice is agreed: every rank returns the same k, and the result is right."""
    comm = Communicator()
    layer = RowParallelLinear(64, 32, comm)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    xs = x[:, slice(*layer.in_range)]
    y = layer(xs)
    full_w = torch.zeros(32, 64)
    full_w[:, slice(*layer.in_range)] = layer.weight.detach()
    comm.all_reduce(full_w)
    assert layer.bias is not None
    want = x @ full_w.t() + layer.bias.detach()
    bad = [] if torch.allclose(y, want, atol=1e-5) else [f"rank {comm.rank}: auto result off"]
    return layer.chunks_for(xs), bad


def mismatched_rows() -> str:
    comm = Communicator()
    layer = RowParallelLinear(8, 4, comm)
    x = torch.ones(3 + comm.rank, layer.weight.shape[1])
    try:
        layer(x)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_gemm_all_reduce_forward(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(forward_grid, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_gemm_all_reduce_blocks(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(blocks_grid, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.parametrize("world", [1, 3, 4])
def test_row_parallel_linear_backward(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(backward_grid, 3, timeout_s=120) for f in r]
    failures += [f for r in pool(world).run(backward_grid, 1, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])


def test_auto_chunks_agree(pool: PoolFn) -> None:
    results = pool(3).run(auto_choice, timeout_s=120)
    assert len({k for k, _ in results}) == 1
    assert 1 <= results[0][0] <= 16
    assert not [f for _, bad in results for f in bad]


def float64_error() -> float:
    """Largest relative error of the fused float64 result against a dense float64 product."""
    comm = Communicator()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=gen, dtype=torch.float64)
    w = torch.randn(9, 40, generator=gen, dtype=torch.float64)
    cols = my_columns(comm, 40)
    got = gemm_all_reduce(comm, x[:, cols].contiguous(), w[:, cols].contiguous(), chunks=2)
    want = x @ w.t()
    return float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())


def test_float64_is_summed_in_float64(pool: PoolFn) -> None:
    """A float32 accumulator would leave errors near 1e-7; float64 sums differ only in order."""
    assert max(pool(3).run(float64_error, timeout_s=60)) < 1e-10


def test_mismatched_shapes_raise(pool: PoolFn) -> None:
    messages = pool(2).run(mismatched_rows, timeout_s=60)
    for message in messages:
        assert (
            "ranks passed different tensors" in message
            and "(3, 4)" in message
            and "(4, 4)" in message
        )


@pytest.mark.parametrize(("hosts", "local"), [(2, 2), (2, 4), (4, 2), (3, 1), (1, 4)])
def test_two_level_bytes_formula(hosts: int, local: int) -> None:
    """With even splits each rank sends 2 ((L - 1) / L) n inside its host and
    2 ((H - 1) / H) n / L across: each host link carries 2 ((H - 1) / H) n, not a flat ring's
    2 ((P - 1) / P) n (2 x 2: n against 1.5 n)."""
    world, n = hosts * local, 96 * hosts * local
    for rank in range(world):
        intra, inter = two_level_sent_bytes([n], hosts, local, rank, 4)
        assert intra == 2 * (local - 1) * n // local * 4
        assert inter == 2 * (hosts - 1) * n // (hosts * local) * 4
        assert local * inter <= 2 * (world - 1) * n // world * 4
        assert (local * inter < 2 * (world - 1) * n // world * 4) == (local > 1)


def test_bad_local_shapes() -> None:
    with pytest.raises(ValueError, match="in_features shard"):
        check_shapes(torch.ones(2, 3), torch.ones(4, 5))


def test_reference_all_reduce_rule() -> None:
    """baselines.all_reduce_algo: two levels for large outputs on layouts of several hosts of
    several ranks, the backend's own otherwise."""
    from commfuse.fused.baselines import HIERARCHICAL_MIN_BYTES, all_reduce_algo

    big = HIERARCHICAL_MIN_BYTES
    assert all_reduce_algo(big, 4, 2) == "hierarchical"
    assert all_reduce_algo(big - 1, 4, 2) == "native"
    assert [all_reduce_algo(big, 4, local) for local in (1, 4)] == ["native", "native"]
    assert all_reduce_algo(big, 6, 4) == "native"  # 4 does not divide 6: no layout


def reference_levels() -> list[str]:
    """The reference on 2 x 2: exact, and its bytes go through the hierarchical all-reduce
    exactly when the rule says so."""
    from commfuse.fused.baselines import HIERARCHICAL_MIN_BYTES

    comm = Communicator()
    failures = []
    kind = label("all_reduce", "hierarchical")
    for rows, local in ((HIERARCHICAL_MIN_BYTES // (4 * 64), 2), (16, 2), (4096, 1)):
        x, w = full_inputs(rows, 8, 64, torch.float32)
        cols = my_columns(comm, 8)
        comm.stats.reset()
        got = gemm_all_reduce_reference(
            comm, x[:, cols].contiguous(), w[:, cols].contiguous(), ranks_per_host=local
        )
        two_level = got.numel() * 4 >= HIERARCHICAL_MIN_BYTES and local == 2
        if not torch.equal(got, x @ w.t()):
            failures.append(f"rank {comm.rank} rows={rows} L={local}: wrong result")
        if (comm.stats[kind].bytes_sent > 0) != two_level:
            failures.append(
                f"rank {comm.rank} rows={rows} L={local}: hierarchical bytes "
                f"{comm.stats[kind].bytes_sent}, expected {'some' if two_level else 'none'}"
            )
    return failures


def test_reference_all_reduces_in_two_levels_on_two_level_layouts(pool: PoolFn) -> None:
    for failures in pool(4).run(reference_levels, timeout_s=120):
        assert failures == []

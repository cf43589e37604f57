"""GEMM + All-to-All and All-to-All + GEMM (MoE combine and dispatch): the fused operators equal
the unfused references and a global single-process computation exactly (integer-valued inputs,
float32 and bfloat16: every value is computed exactly and rounded once), forward and backward
through ``torch.ops.commfuse.*``, for world sizes 1-5, uneven experts per rank, a rank with no
tokens for some expert, a rank that sends nothing, chunk counts that do not divide the rows; each
rank sends exactly the bytes of the pairwise reference All-to-All (off-diagonal blocks) and the
backward sends back what the forward received. Bad routing raises ValueError."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.fused import gemm_all_to_all as ga
from commfuse.fused.chunking import split_sizes
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
PAIRWISE = label("all_to_all", "pairwise")
K, H, N = 4, 3, 5  # features in, hidden, out


def setup(world: int) -> tuple[list[int], torch.Tensor]:
    """Uneven experts per rank (world + 1 experts) and counts with zeros: rank 0 sends nothing
    to the last expert, rank 2 (when there is one) sends nothing at all."""
    experts = split_sizes(world + 1, world)
    counts = torch.randint(0, 4, (world, world + 1), generator=torch.Generator().manual_seed(world))
    counts[0, -1] = 0
    if world >= 3:
        counts[2] = 0
    return experts, counts


def rank_data(
    counts: torch.Tensor, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s token-side rows, the gradient of its output, and each row's expert."""
    gen = torch.Generator().manual_seed(10 + rank)
    rows = int(counts[rank].sum())
    x = torch.randint(-2, 3, (rows, K), generator=gen).to(dtype)
    g = torch.randint(-2, 3, (rows, N), generator=gen).to(dtype)
    expert = torch.repeat_interleave(torch.arange(counts.shape[1]), counts[rank])
    return x, g, expert


def full_weights(num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    w1 = torch.randint(-2, 3, (num_experts, H, K), generator=gen).double()
    w2 = torch.randint(-2, 3, (num_experts, N, H), generator=gen).double()
    return w1, w2


def expected(counts: torch.Tensor, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Output and gradients of ``y = (x W1_e^T) W2_e^T`` per row, all ranks' rows, in float64."""
    w1, w2 = full_weights(counts.shape[1])
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    mine: dict[str, torch.Tensor] = {}
    loss = torch.zeros((), dtype=torch.float64)
    for i in range(world):
        x, g, e = rank_data(counts, i, torch.float64)
        x.requires_grad_(True)
        y = torch.einsum("th,tnh->tn", torch.einsum("tk,thk->th", x, w1[e]), w2[e])
        loss = loss + (y * g).sum()
        if i == rank:
            mine["y"], mine["x"] = y.detach(), x
    loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
    assert w1.grad is not None and w2.grad is not None and mine["x"].grad is not None
    mine.update(grad_x=mine["x"].grad, grad_w1=w1.grad, grad_w2=w2.grad)
    return mine


def op_grid() -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    experts, counts = setup(world)
    rt = ga.Routing(comm, counts, experts)
    flat = counts.reshape(-1).tolist()
    lo, hi = sum(experts[:rank]), sum(experts[: rank + 1])
    want = expected(counts, world, rank)
    failures: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        w1_full, w2_full = full_weights(counts.shape[1])
        x0, g, _ = rank_data(counts, rank, dtype)
        # References, with the pairwise All-to-All so that their bytes are exact.
        comm.stats.reset()
        h_ref, _ = ga.all_to_all_gemm_reference(
            comm, rt, x0, w1_full[lo:hi].to(dtype), algo="pairwise"
        )
        y_ref = ga.gemm_all_to_all_reference(comm, rt, h_ref, w2_full[lo:hi].to(dtype), "pairwise")
        ref_bytes = comm.stats[PAIRWISE].bytes_sent
        for chunks in (1, 2, 3, 7):
            where = f"rank {rank} {dtype} chunks={chunks}"
            x = x0.clone().requires_grad_(True)
            w1 = w1_full[lo:hi].to(dtype).requires_grad_(True)
            w2 = w2_full[lo:hi].to(dtype).requires_grad_(True)
            comm.stats.reset()
            h, _ = torch.ops.commfuse.all_to_all_gemm(x, w1, flat, experts, comm.key, chunks)
            y = torch.ops.commfuse.gemm_all_to_all(h, w2, flat, experts, comm.key, chunks)
            forward = comm.stats[ga.LABEL]
            sent, received = forward.bytes_sent, forward.bytes_recv
            if chunks > 1 and world > 1 and forward.messages_sent != forward_messages(rt, chunks):
                failures.append(
                    f"{where}: forward sent {forward.messages_sent} messages, "
                    f"expected {forward_messages(rt, chunks)}"
                )
            comm.stats.reset()
            (y * g).sum().backward()
            backward = comm.stats[ga.LABEL]
            assert x.grad is not None and w1.grad is not None and w2.grad is not None
            checks = {
                "y": (y, want["y"]),
                "y vs reference": (y, y_ref),
                "h vs reference": (h, h_ref),
                "grad_x": (x.grad, want["grad_x"]),
                "grad_w1": (w1.grad, want["grad_w1"][lo:hi]),
                "grad_w2": (w2.grad, want["grad_w2"][lo:hi]),
            }
            for name, (got, exp) in checks.items():
                if not torch.equal(got, exp.to(dtype)):
                    failures.append(f"{where}: {name} differs: {got.tolist()} vs {exp.tolist()}")
            if chunks > 1 and world > 1:
                if sent != ref_bytes:
                    failures.append(f"{where}: fused sent {sent} bytes, reference {ref_bytes}")
                if backward.bytes_sent != received:
                    failures.append(
                        f"{where}: backward sent {backward.bytes_sent}, forward received {received}"
                    )
    return failures


def forward_messages(rt: ga.Routing, chunks: int) -> int:
    """Messages one rank sends in the fused forward: the dispatch cuts every remote block into
    ``chunks`` pieces (its sources arrive together), the combine into ``ceil(chunks / (P - 1))``
    (its destinations are computed in turn); a block never has more pieces than rows, and an
    empty one sends nothing."""
    per_block = -(-chunks // (rt.world - 1))
    remote = [d for d in range(rt.world) if d != rt.rank]
    dispatch = sum(min(chunks, rt.send_rows[d]) for d in remote)
    combine = sum(min(per_block, rt.recv_rows[d]) for d in remote)
    return dispatch + combine


def arrival_order(chunks: int) -> list[tuple[int, int]]:
    """(source, first row) of each ``compute`` call of the dispatch exchange, with 6 rows from
    every rank to every rank."""
    comm = Communicator()
    world = comm.world_size
    rt = ga.Routing(comm, torch.full((world, world), 6), [1] * world)
    calls: list[tuple[int, int]] = []
    ga.exchange_then_compute(
        comm, rt, torch.zeros(6 * world, 2), chunks, lambda s, lo, hi, rows: calls.append((s, lo))
    )
    return calls


def test_dispatch_computes_pieces_in_the_order_they_arrive(pool: PoolFn) -> None:
    """The local block first, then piece-major: piece 0 of r-1, r-2, ..., then piece 1 (all
    sources send at once, so each source's first piece arrives before any source's second)."""
    for rank, calls in enumerate(pool(3).run(arrival_order, 3, timeout_s=60)):
        others = [(rank - 1) % 3, (rank - 2) % 3]
        assert calls == [(rank, 0)] + [(src, lo) for lo in (0, 2, 4) for src in others]


def bad_inputs() -> list[str]:
    comm = Communicator()
    world = comm.world_size
    experts, counts = setup(world)
    rt = ga.Routing(comm, counts, experts)
    w = torch.zeros(experts[comm.rank], N, H)
    messages = []
    attempts: list[Callable[[], object]] = [
        lambda: ga.Routing(comm, counts[:, :-1], experts),
        lambda: ga.Routing(comm, counts, [0] * world),
        lambda: ga.gemm_all_to_all(comm, rt, torch.zeros(rt.recv_start[-1] + 1, H), w, chunks=2),
        lambda: ga.gemm_all_to_all(comm, rt, torch.zeros(rt.recv_start[-1], H + 1), w, chunks=2),
        lambda: ga.gemm_all_to_all(comm, rt, torch.zeros(rt.recv_start[-1], H), w, chunks=0),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_moe_operators_exact(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(op_grid, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])


def test_moe_operators_bad_input(pool: PoolFn) -> None:
    messages = pool(2).run(bad_inputs, timeout_s=60)[0]
    assert "counts must be" in messages[0]
    assert "experts_per_rank needs 2 entries >= 1" in messages[1]
    assert "expert-side rows must be" in messages[2]
    assert "must equal the weight's in_features" in messages[3]
    assert "chunks must be >= 1" in messages[4]


def test_bench_gemm_all_to_all_records(pool: PoolFn) -> None:
    from commfuse.bench.fused import FusedBenchConfig, bench_fused_on_rank

    config = FusedBenchConfig(ops=("gemm_all_to_all",), iters=1, warmup=1, shapes=((40, 8, 12, 2),))
    records = pool(3).run(bench_fused_on_rank, config, timeout_s=120)[0]
    assert [r["op"] for r in records] == ["gemm_all_to_all"]
    r = records[0]
    assert r["wrong"] == 0 and r["world_size"] == 3 and r["shape"] == [40, 8, 12, 2]
    assert 1 <= r["chunks"] <= 8 and r["ideal_us"] == max(r["compute_us"], r["comm_us"])


@pytest.mark.e2e
def test_bench_moe_step_records(pool: PoolFn) -> None:
    from commfuse.bench.fused import FusedBenchConfig, bench_fused_on_rank

    config = FusedBenchConfig(ops=("moe_step",), iters=1, warmup=1, shapes=((16, 8, 8, 1),))
    records = pool(2).run(bench_fused_on_rank, config, timeout_s=120)[0]
    # The layer's choice, then each fixed count in the same rounds (wall and CPU of each).
    assert [r["op"] for r in records] == [
        "moe_step",
        "moe_step[k=2]",
        "moe_step[k=3]",
        "moe_step[k=5]",
    ]
    assert all(r["wrong"] == 0 for r in records) and records[0]["chunks"] >= 1
    assert {"fused", "fused[k=2]", "fused[k=5]"} <= set(records[0]["cpu_us"])
    assert all(records[0]["cpu_us"][n] > 0 for n in ("fused[k=2]", "fused[k=5]"))
    # What the machine's cores did meanwhile, by kind, for every variant.
    machine = records[0]["machine_us"]
    assert set(machine) == {
        "busy",
        "idle",
        "softirq",
        "steal",
        "ranks",
        "others",
        "interval",
        "kernel",
    }
    assert all(set(by_variant) == set(records[0]["cpu_us"]) for by_variant in machine.values())
    # Every kind but the kernel's, busy less two counts of ticks, which can read below 0.
    counted = [by_variant for kind, by_variant in machine.items() if kind != "kernel"]
    assert all(v >= 0 for by_variant in counted for v in by_variant.values())
    assert machine["interval"]["fused"] >= records[0]["fused_us"] * 0.5

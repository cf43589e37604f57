"""ExpertParallelMoE: top-k gating, capacity, experts sharded across ranks, both All-to-Alls
fused. Forward: fused (3 chunks) equals unfused (1 chunk) bitwise (integer-valued experts, so
expert outputs are exact) and the single-process ``dense_moe_reference`` over the global batch
(float32: rtol 1e-5; bfloat16: rtol 2e-2). Backward: float32 gradients of x, experts and the
gate (averaged like a data-parallel parameter) match the dense model's (rtol 1e-4); bfloat16
gradients of the fused and unfused layers agree (rtol 2e-2). The counts travel in one message
to each peer (its columns and the features), with no all-gather. World sizes 1-5, a rank with no
tokens, uneven experts per rank, dropped assignments; mismatched features raise ValueError; the
automatic chunk choice is agreed by all ranks. The fallback choice itself is tested in one
process (``choose_against_unfused``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from commfuse.comm import Communicator
from commfuse.fused import ChunkConfig, ExpertParallelMoE
from commfuse.fused.fallback import (
    Measured,
    choose_against_unfused,
    confirm_by_trial,
    fewest_pieces_that_pay,
    pieces_that_pay,
    trial_verdict,
)
from commfuse.fused.moe import COUNTS_LABEL, dense_moe_reference, route_tokens
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
D, HID = 6, 4
TOKENS = [5, 0, 7, 3, 6]  # rank 1 has no tokens


def tokens(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randint(-2, 3, (TOKENS[rank], D), generator=gen).to(dtype)
    g = torch.randint(-2, 3, (TOKENS[rank], D), generator=gen).to(dtype)
    return x, g


def integer_experts(num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    w1 = torch.randint(-1, 2, (num_experts, HID, D), generator=gen).float()
    w2 = torch.randint(-1, 2, (num_experts, D, HID), generator=gen).float()
    return w1, w2


def make_layer(
    comm: Communicator, num_experts: int, cf: float | None, dtype: torch.dtype, chunks: int | None
) -> ExpertParallelMoE:
    layer = ExpertParallelMoE(
        D,
        HID,
        num_experts,
        comm,
        top_k=2,
        capacity_factor=cf,
        activation="relu",
        dtype=dtype,
        chunk_config=ChunkConfig(num_chunks=chunks),
        seed=3,
    )
    w1, w2 = integer_experts(num_experts)
    lo, hi = layer.expert_range
    with torch.no_grad():
        layer.w1.copy_(w1[lo:hi])
        layer.w2.copy_(w2[lo:hi])
    return layer


def module_grid(num_experts: int, cf: float | None) -> tuple[list[str], int]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    kept = 0
    for dtype in (torch.float32, torch.bfloat16):
        x0, g = tokens(rank, dtype)
        results = {}
        for chunks in (1, 3):
            layer = make_layer(comm, num_experts, cf, dtype, chunks)
            x = x0.clone().requires_grad_(True)
            comm.stats.reset()
            out = layer(x)
            # The counts: one message to each peer, that peer's columns and the two features.
            sent = comm.stats[COUNTS_LABEL]
            want = sum(8 * (n + 2) for j, n in enumerate(layer.experts_per_rank) if j != rank)
            if (sent.messages_sent, sent.bytes_sent, sent.messages_recv) != (
                world - 1,
                want,
                world - 1,
            ) or comm.stats["all_gather"].calls:
                failures.append(f"rank {rank}: counts exchange sent {sent} for {want} bytes")
            (out * g).sum().backward()
            assert x.grad is not None and layer.gate.grad is not None
            gate_grad = layer.gate.grad.float().clone()
            comm.all_reduce(gate_grad)  # what data parallelism does with the replicated gate
            results[chunks] = (layer, out, x.grad, gate_grad)
        where = f"rank {rank} {dtype} experts={num_experts} cf={cf}"
        (l1, out1, gx1, gg1), (l3, out3, gx3, gg3) = results[1], results[3]
        if not torch.equal(out1, out3):
            failures.append(f"{where}: fused output differs from unfused")
        # The dense model over the global batch (each rank's tokens routed with its capacity).
        w1, w2 = (w.to(dtype).requires_grad_(True) for w in integer_experts(num_experts))
        gate = l1.gate.detach().clone().requires_grad_(True)
        loss = torch.zeros(())
        mine: torch.Tensor | None = None
        for i in range(world):
            xi, gi = tokens(i, dtype)
            xi.requires_grad_(True)
            yi = dense_moe_reference(
                xi, gate, w1, w2, top_k=2, capacity_factor=cf, activation="relu"
            )
            loss = loss + (yi.float() * gi.float()).sum()
            if i == rank:
                mine, x_ref, y_ref = xi, xi, yi
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        assert mine is not None and x_ref.grad is not None and w1.grad is not None
        assert w2.grad is not None and gate.grad is not None
        lo, hi = l1.expert_range
        tol: dict[str, Any] = (
            {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
        )
        if not torch.allclose(out3.float(), y_ref.float(), **tol):
            failures.append(f"{where}: output differs from the dense reference")
        grads = {
            "grad_x": (gx3, gx1, x_ref.grad),
            "grad_w1": (l3.w1.grad, l1.w1.grad, w1.grad[lo:hi]),
            "grad_w2": (l3.w2.grad, l1.w2.grad, w2.grad[lo:hi]),
            "grad_gate": (gg3, gg1, gate.grad),
        }
        for name, (fused, unfused, dense) in grads.items():
            assert fused is not None and unfused is not None
            if not torch.allclose(fused.float(), unfused.float(), rtol=2e-2, atol=5e-2):
                failures.append(f"{where}: {name} fused vs unfused differ")
            if dtype == torch.float32 and not torch.allclose(fused, dense, rtol=1e-4, atol=1e-4):
                failures.append(f"{where}: {name} differs from dense {fused} {dense}")
        routed = route_tokens(x0 @ l1.gate.detach().t(), 2, capacity_factor=cf, normalize=True)
        kept = int(routed.counts.sum())
    return failures, kept


def mismatched_features() -> str:
    comm = Communicator()
    width = D + comm.rank
    layer = ExpertParallelMoE(width, HID, 2, comm, top_k=1)
    try:
        layer(torch.ones(3, width))
    except ValueError as err:
        return str(err)
    return "no error"


def auto_chunks() -> tuple[int, bool]:
    comm = Communicator()
    x, _ = tokens(comm.rank, torch.float32)
    auto = make_layer(comm, comm.world_size + 1, None, torch.float32, None)
    ref = make_layer(comm, comm.world_size + 1, None, torch.float32, 1)
    out = auto(x)
    return auto._chunks[torch.float32], torch.equal(out, ref(x))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_moe_module(pool: PoolFn, world: int) -> None:
    results = pool(world).run(module_grid, world + 2, None, timeout_s=180)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures[:8])


def test_moe_module_capacity_drops(pool: PoolFn) -> None:
    # capacity ceil(0.5 * T * 2 / 4) per expert: some of the T * 2 assignments are dropped.
    results = pool(3).run(module_grid, 4, 0.5, timeout_s=180)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures[:8])
    assert sum(kept for _, kept in results) < 2 * sum(TOKENS[:3])


def test_moe_mismatched_features(pool: PoolFn) -> None:
    for message in pool(2).run(mismatched_features, timeout_s=60):
        assert "ranks passed different token features" in message
        assert "rank 0: 6 features" in message and "rank 1: 7 features" in message


def test_moe_auto_chunks_agree(pool: PoolFn) -> None:
    results = pool(3).run(auto_chunks, timeout_s=120)
    assert len({k for k, _ in results}) == 1 and results[0][0] >= 1
    assert all(same for _, same in results)


def test_fallback_choice() -> None:
    # Fused transport slower than gloo's: chunking is predicted to lose, so one chunk.
    slow = Measured(compute_us=100, fused_comm_us=200, unfused_comm_us=100, overhead_us=1)
    assert choose_against_unfused(slow, max_chunks=16, min_gain=0.05) == 1
    # Same transport, C = M: chunking pays (max + min / k + k o, k* = sqrt(100 / 1) = 10).
    even = Measured(compute_us=100, fused_comm_us=100, unfused_comm_us=100, overhead_us=1)
    assert choose_against_unfused(even, max_chunks=16, min_gain=0.05) == 10
    # One side negligible: nothing to hide.
    tiny = Measured(compute_us=1, fused_comm_us=1000, unfused_comm_us=1000, overhead_us=5)
    assert choose_against_unfused(tiny, max_chunks=16, min_gain=0.05) == 1


def test_trial_verdict_judges_paired_rounds() -> None:
    # Per-round ratios fused / unfused; their median decides (no time is measured here).
    assert trial_verdict([100, 100, 100], [80, 90, 94], min_gain=0.05) == "faster"
    assert trial_verdict([100, 100, 100], [97, 98, 120], min_gain=0.05) == "unclear"
    assert trial_verdict([100, 100, 100], [90, 100, 101], min_gain=0.05) == "not faster"
    # A loaded round slows both variants alike: the pairs still say faster, where the medians
    # taken apart (unfused 100, fused 120) would say slower.
    loaded = trial_verdict([100, 100, 200, 200, 200], [90, 92, 120, 120, 120], min_gain=0.05)
    assert loaded == "faster"
    with pytest.raises(ValueError, match="same number"):
        trial_verdict([100, 100], [90], min_gain=0.05)


def trial_choices() -> tuple[int, int]:
    """A fused candidate 20x slower than unfused is rejected, one 20x faster kept (real runs)."""
    comm = Communicator()

    def slow(_: int) -> None:
        time.sleep(0.04)

    def fast(_: int = 0) -> None:
        time.sleep(0.002)

    rejected = confirm_by_trial(comm, 4, slow, fast, runs=3, min_gain=0.05)
    kept = confirm_by_trial(comm, 4, fast, lambda: slow(0), runs=3, min_gain=0.05)
    return rejected, kept


def test_fallback_trial(pool: PoolFn) -> None:
    assert pool(2).run(trial_choices, timeout_s=60) == [(1, 4), (1, 4)]


def unclear_trials() -> tuple[int, int, int]:
    """A fused run at 3/4 of the unfused one with min_gain 0.5: the ratio lies between 0.5 and 1,
    an unclear trial, which keeps the chunks or falls back as asked; a fused run twice as slow
    falls back even where unclear trials keep (real runs on every rank)."""
    comm = Communicator()

    def unfused() -> None:
        time.sleep(0.04)

    def fused(_: int) -> None:
        time.sleep(0.03)

    def slow(_: int) -> None:
        time.sleep(0.08)

    kept, dropped = (
        confirm_by_trial(comm, 4, fused, unfused, runs=5, min_gain=0.5, unclear_keeps=keep)
        for keep in (True, False)
    )
    slower = confirm_by_trial(comm, 4, slow, unfused, runs=3, min_gain=0.05, unclear_keeps=True)
    return kept, dropped, slower


def test_fallback_trial_unclear(pool: PoolFn) -> None:
    assert pool(2).run(unclear_trials, timeout_s=60) == [(4, 1, 1), (4, 1, 1)]


def test_pieces_must_pay_for_themselves() -> None:
    # Paired rounds of k = 2 and k = 5 (no time is measured here): the fewer pieces stay unless
    # the more are faster by min_gain, or faster at all for no more CPU.
    two = [100.0, 100.0, 100.0]
    same_wall = {2: two, 5: [99.0, 101.0, 99.0]}
    assert pieces_that_pay(same_wall, {2: two, 5: [120.0] * 3}, min_gain=0.05) == 2
    assert pieces_that_pay(same_wall, {2: two, 5: [90.0] * 3}, min_gain=0.05) == 5
    faster = {2: two, 5: [90.0, 93.0, 200.0]}
    assert pieces_that_pay(faster, {2: two, 5: [150.0] * 3}, min_gain=0.05) == 5
    slower = {2: two, 5: [101.0, 105.0, 90.0]}
    assert pieces_that_pay(slower, {2: two, 5: [50.0] * 3}, min_gain=0.05) == 2


def cpu_judged_trials() -> tuple[int, int]:
    """Real runs on every rank against an unfused form that sleeps 60 ms: ``k`` pieces sleep
    20 ms while a second thread spins ``6 (k - 2)`` ms of CPU (the same wall, more CPU for more
    pieces), then pieces that shorten the sleep (5 pieces 10 ms, 2 pieces 30 ms)."""
    comm = Communicator()

    def spin(ms: float) -> None:
        end = time.process_time() + ms / 1e3
        while time.process_time() < end:
            pass

    def costly(k: int) -> None:
        worker = threading.Thread(target=spin, args=(6.0 * (k - 2),))
        worker.start()
        time.sleep(0.02)
        worker.join()

    def quicker(k: int) -> None:
        time.sleep(0.01 if k == 5 else 0.03)

    def unfused() -> None:
        time.sleep(0.06)

    return tuple(  # type: ignore[return-value]
        fewest_pieces_that_pay(comm, [5, 2], fn, unfused, runs=3, min_gain=0.05)
        for fn in (costly, quicker)
    )


def test_trial_counts_cpu_of_every_piece(pool: PoolFn) -> None:
    assert pool(2).run(cpu_judged_trials, timeout_s=60) == [(2, 5), (2, 5)]

"""Linear-attention sequence parallelism (LASP, LASP-2): on 1-4 gloo ranks, the output and the
gradients of q, k and v equal single-process causal linear attention in float64, with and
without a per-head decay, for odd sequence lengths split unevenly (an empty shard included, no
padding); each rank's traffic is exactly the algorithm's (LASP: one state to the next rank
forward and one state gradient to the previous backward, P - 1 messages each way; LASP-2: one
all-gather of the states each way), the same bytes at three sequence lengths; ranks that
disagree on the state's shape get a clear error. The chunked single-process attention equals
the token-by-token recurrence."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from commfuse.comm import Communicator
from commfuse.fused.lasp import LABEL, lasp
from commfuse.fused.lasp2 import lasp2
from commfuse.fused.linear_attention import causal_linear_attention, local_backward
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
B, H, D, E = 2, 3, 4, 5
STATE_BYTES = B * H * D * E * 8  # one float64 state [B, H, d, e]
DECAY = torch.tensor([1.0, 0.9, 0.6], dtype=torch.float64)

#: Uneven shards of odd totals (an empty one at P = 3 and P = 4).
SPLITS = {
    1: [[13]],
    2: [[8, 5], [2, 11]],
    3: [[6, 0, 7], [5, 5, 3]],
    4: [[4, 5, 0, 4], [1, 3, 5, 4]],
}


def inputs(total: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, total, D), (B, H, total, D), (B, H, total, E), (B, H, total, E))
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor
) -> torch.Tensor:
    """``o_t = q_t S_t``, ``S_t = lambda S_{t-1} + k_t^T v_t``, one token at a time."""
    state = q.new_zeros((B, H, D, E))
    out = []
    for t in range(q.shape[2]):
        state = decay.view(1, H, 1, 1) * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], state))
    return torch.stack(out, dim=2)


def test_chunked_attention_equals_the_recurrence() -> None:
    q, k, v, _ = inputs(23, 0)
    for decay in (DECAY, torch.ones(H, dtype=torch.float64)):
        want = recurrence(q, k, v, decay)
        for block in (1, 4, 23, 64):
            got = causal_linear_attention(q, k, v, decay if decay[1] < 1 else None, block=block)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_every_buffer_follows_the_inputs_device() -> None:
    """On meta inputs (a decay on the CPU) a buffer made on the CPU would fail the first
    operation that mixes it in: forward and backward make theirs with the inputs' device."""
    q, v = torch.empty(1, H, 9, D, device="meta"), torch.empty(1, H, 9, E, device="meta")
    state = torch.empty(1, H, D, E, device="meta")
    assert causal_linear_attention(q, q, v, DECAY, block=4).shape == (1, H, 9, E)
    grads = local_backward((q, q, v, state), DECAY, 4, torch.empty_like(v))
    assert [g.shape for g in grads] == [q.shape, q.shape, v.shape]


def test_half_precision_keeps_the_decay_of_late_rows() -> None:
    """bfloat16 inputs: the decays of positions past 256 (which bfloat16 cannot count) are
    computed in float32, so the output stays within bfloat16's rounding of float64's."""
    q, k, v, _ = inputs(600, 3)
    decay = torch.tensor([1.0, 0.999, 0.99], dtype=torch.float64)
    want = causal_linear_attention(q, k, v, decay, block=64)
    got = causal_linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), decay, block=64)
    scale = want.abs().amax(dim=2, keepdim=True) + 1
    assert float(((got.double() - want) / scale).abs().max()) < 0.1


def expected_traffic(
    method: str, rank: int, world: int, backward: bool
) -> dict[str, dict[str, int]]:
    """The communicator's counters one call (forward or backward) must leave on ``rank``."""
    if method == "lasp2":
        return {
            "all_gather": dict(_zero(), calls=1, native_bytes=STATE_BYTES, handed_bytes=STATE_BYTES)
        }
    sends = int(rank > 0 if backward else rank < world - 1)
    recvs = int(rank < world - 1 if backward else rank > 0)
    if sends + recvs == 0:
        return {}
    counters = dict(_zero(), calls=sends + recvs, messages_sent=sends, messages_recv=recvs)
    counters.update(bytes_sent=sends * STATE_BYTES, bytes_recv=recvs * STATE_BYTES)
    return {LABEL: counters}


def _zero() -> dict[str, int]:
    keys = ("calls", "messages_sent", "messages_recv", "bytes_sent", "bytes_recv")
    return dict.fromkeys((*keys, "native_bytes", "handed_bytes"), 0)


def run_one(
    comm: Communicator, method: str, splits: list[int], decay: torch.Tensor | None, seed: int
) -> list[str]:
    """One forward and backward of ``method`` on this rank's shard against the whole sequence."""
    rank, world = comm.rank, comm.world_size
    full = inputs(sum(splits), seed)
    start = sum(splits[:rank])
    mine = slice(start, start + splits[rank])
    truth = [t.clone().requires_grad_(True) for t in full[:3]]
    want = causal_linear_attention(truth[0], truth[1], truth[2], decay, block=4)
    (want * full[3]).sum().backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
    shard = [t[:, :, mine].clone().requires_grad_(True) for t in full[:3]]
    where = f"rank {rank}/{world} {method} splits={splits} decay={decay is not None}"
    comm.stats.reset()
    q, k, v = shard
    if method == "lasp":
        out = lasp(comm, q, k, v, decay, block=3)
    else:
        out = lasp2(comm, q, k, v, decay, splits=splits, block=3)
    failures = []
    if comm.stats.snapshot() != expected_traffic(method, rank, world, backward=False):
        failures.append(f"{where}: forward traffic {comm.stats.snapshot()}")
    comm.stats.reset()
    (out * full[3][:, :, mine]).sum().backward()  # type: ignore[no-untyped-call]
    if comm.stats.snapshot() != expected_traffic(method, rank, world, backward=True):
        failures.append(f"{where}: backward traffic {comm.stats.snapshot()}")
    if not torch.allclose(out, want[:, :, mine], rtol=1e-9, atol=1e-9):
        failures.append(f"{where}: output differs by {(out - want[:, :, mine]).abs().max()}")
    for name, got, ref in zip("qkv", shard, truth, strict=True):
        assert ref.grad is not None
        if got.grad is None or not torch.allclose(
            got.grad, ref.grad[:, :, mine], rtol=1e-9, atol=1e-9
        ):
            failures.append(f"{where}: grad_{name} differs")
    return failures


def exact() -> list[str]:
    comm = Communicator()
    failures = []
    for method in ("lasp", "lasp2"):
        for splits in SPLITS[comm.world_size]:
            for decay in (None, DECAY):
                failures += run_one(comm, method, splits, decay, seed=sum(splits) + len(splits))
    return failures


def three_lengths() -> list[str]:
    """The same bytes per rank (the state's) at 3, 7 and 31 rows per rank."""
    comm = Communicator()
    failures = []
    for rows in (3, 7, 31):
        splits = [rows] * comm.world_size
        for method in ("lasp", "lasp2"):
            failures += run_one(comm, method, splits, DECAY, seed=rows)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_lasp_and_lasp2_equal_single_process_attention(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(exact, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


def test_bytes_per_rank_do_not_grow_with_the_sequence(pool: PoolFn) -> None:
    failures = [f for r in pool(3).run(three_lengths, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


def errors() -> list[str]:
    comm = Communicator()
    rank = comm.rank
    q, v = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 5)
    failures: list[str] = []
    checks: dict[str, Callable[[], Any]] = {
        "one value per head": lambda: lasp(comm, q, q, v, torch.ones(3)),
        "must lie in (0, 1]": lambda: lasp2(comm, q, q, v, torch.tensor([0.5, 1.5])),
        "needs q, k [B, H, N, d]": lambda: lasp(comm, q[0], q[0], v[0]),
        "cast them to one": lambda: lasp2(comm, q, q, v.double()),
        "block must be >= 1": lambda: lasp(comm, q, q, v, block=0),
        "splits needs": lambda: lasp2(comm, q, q, v, splits=[3] * (comm.world_size + 1)),
        # Ranks that disagree on the sequence's length (each one's splits fit its own shard).
        "ranks passed different tensors ": lambda: lasp2(
            comm,
            q[:, :, : 2 + rank],
            q[:, :, : 2 + rank],
            v[:, :, : 2 + rank],
            splits=[2, 2 + rank],
        ),
        # Ranks that disagree on e (the values' width): every rank raises, naming each shape.
        "ranks passed different tensors": lambda: lasp(comm, q, q, torch.ones(1, 2, 3, 5 + rank)),
    }
    for needle, call in checks.items():
        try:
            call()
            failures.append(f"rank {rank}: no error for {needle!r}")
        except ValueError as err:
            if needle not in str(err):
                failures.append(f"rank {rank}: unclear error {err}")
    return failures


def test_bad_input_and_mismatched_ranks_raise_clear_errors(pool: PoolFn) -> None:
    failures = [f for r in pool(2).run(errors, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])

"""Embedding + All-to-All (sharded EmbeddingBag): the fused operator equals the unfused reference
and a single-process EmbeddingBag over all tables, forward and backward (table gradients), for
world sizes 1-5, uneven batch splits (a rank with no samples), ranks owning no table, empty bags,
sum and mean, float32 and bfloat16 (sum exact on integer-valued tables; mean within 2 ulps
of bfloat16, rtol 1.6e-2); it sends exactly the reference's off-diagonal bytes, and its
backward sends the same bytes back."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.fused import ChunkConfig, ShardedEmbeddingBag
from commfuse.fused.chunking import BY_TABLE, ChunkSchedule, split_sizes
from commfuse.fused.embedding_all_to_all import (
    LABEL,
    ShardedLookup,
    embedding_all_to_all,
    embedding_all_to_all_reference,
)
from commfuse.fused.fallback import fastest_by_trial
from commfuse.fused.table_gradients import PreparedGradients
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]
PAIRWISE = label("all_to_all", "pairwise")


def bags(table: int, rows: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global-batch EmbeddingBag inputs of one table: lengths 0-3 (empty bags included)."""
    gen = torch.Generator().manual_seed(100 + table)
    lengths = torch.randint(0, 4, (batch,), generator=gen)
    offsets = torch.cumsum(lengths, 0) - lengths
    indices = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return indices, offsets


def splits_for(world: int, batch: int) -> list[int]:
    """Uneven samples per rank; rank 1 has none when world > 2."""
    if world <= 2:
        return [batch - batch // 3, batch // 3][:world] if world == 2 else [batch]
    weights = [2] + [0] + [1 + (r % 2) for r in range(2, world)]
    base = [batch * w // sum(weights) for w in weights]
    base[0] += batch - sum(base)
    return base


def grid(num_tables: int) -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    rows = [7, 3, 10, 1, 4, 6][:num_tables]
    batch = 11
    splits = splits_for(world, batch)
    mine = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ("sum", "mean"):
            chunk_configs = [ChunkConfig(num_chunks=k) for k in (1, 2, 5)]
            for config in [*chunk_configs, ChunkConfig(schedule=BY_TABLE)]:
                chunks = config.fixed()
                module = ShardedEmbeddingBag(
                    rows,
                    3,
                    comm,
                    mode=mode,
                    dtype=dtype,
                    chunk_config=config,
                )
                full = [
                    torch.randint(-3, 4, (n, 3), generator=torch.Generator().manual_seed(t)).to(
                        dtype
                    )
                    for t, n in enumerate(rows)
                ]
                with torch.no_grad():
                    for p, t in zip(module.tables, module.local_tables, strict=True):
                        p.copy_(full[t])
                inputs = [bags(t, rows[t], batch) for t in range(num_tables)]
                idx = [inputs[t][0] for t in module.local_tables]
                off = [inputs[t][1] for t in module.local_tables]
                where = f"rank {rank} {dtype} {mode} chunks={chunks} tables={num_tables}"
                comm.stats.reset()
                out = module(idx, off, splits)
                fused = comm.stats[LABEL]
                sent_fwd, recv_fwd = fused.bytes_sent, fused.bytes_recv
                # Single-process truth: every table, every sample, then my rows.
                leaves = [w.clone().requires_grad_(True) for w in full]
                truth = torch.stack(
                    [
                        F.embedding_bag(inputs[t][0], leaves[t], inputs[t][1], mode=mode)
                        for t in range(num_tables)
                    ],
                    dim=1,
                )
                exact = mode == "sum"
                ok = (
                    torch.equal(out, truth[mine])
                    if exact
                    else torch.allclose(out.float(), truth[mine].float(), rtol=1.6e-2, atol=1e-2)
                )
                if not ok:
                    failures.append(f"{where}: forward differs")
                # Unfused reference with exact point-to-point accounting (pairwise all-to-all).
                comm.stats.reset()
                detached = [p.detach() for p in module.tables]
                lookup = module.lookup(idx, off, splits, detached)
                ref = embedding_all_to_all_reference(comm, lookup, algo="pairwise")
                if not torch.equal(ref.index_select(1, module.order), out.detach()):
                    failures.append(f"{where}: fused differs from the unfused reference")
                want_bytes = comm.stats[PAIRWISE].bytes_sent if world > 1 else 0
                if chunks != 1 and sent_fwd != want_bytes:
                    failures.append(f"{where}: sent {sent_fwd} bytes, reference {want_bytes}")
                if chunks == BY_TABLE and world > 1:
                    # One message per (table, peer): to each peer with samples, from each peer's
                    # tables when this rank has samples.
                    owned = len(module.local_tables)
                    want = (
                        owned * sum(1 for r in range(world) if r != rank and splits[r]),
                        num_tables - owned if splits[rank] else 0,
                    )
                    if (fused.messages_sent, fused.messages_recv) != want:
                        failures.append(
                            f"{where}: sent/received {fused.messages_sent}/{fused.messages_recv} "
                            f"messages, want {want}"
                        )
                # Backward: gradients of my tables against the single-process ones.
                g = torch.randint(
                    -2, 3, (batch, num_tables, 3), generator=torch.Generator().manual_seed(5)
                ).to(dtype)
                comm.stats.reset()
                (out * g[mine]).sum().backward()
                back = comm.stats[LABEL]
                (truth * g).sum().backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
                for p, t in zip(module.tables, module.local_tables, strict=True):
                    grad_truth = leaves[t].grad
                    assert p.grad is not None and grad_truth is not None
                    close = (
                        torch.equal(p.grad, grad_truth)
                        if exact
                        else torch.allclose(
                            p.grad.float(), grad_truth.float(), rtol=1.6e-2, atol=1e-2
                        )
                    )
                    if not close:
                        failures.append(f"{where}: grad of table {t} differs")
                if chunks != 1 and (back.bytes_sent, back.bytes_recv) != (recv_fwd, sent_fwd):
                    failures.append(
                        f"{where}: backward sent/recv {back.bytes_sent}/{back.bytes_recv}, forward {sent_fwd}/{recv_fwd}"
                    )
    return failures


def direct_call_and_errors() -> list[str]:
    """The function form, auto chunk choice, and clear errors for bad input."""
    comm = Communicator()
    failures: list[str] = []
    module = ShardedEmbeddingBag([5, 5], 2, comm)
    idx = [bags(t, 5, 6)[0] for t in module.local_tables]
    off = [bags(t, 5, 6)[1] for t in module.local_tables]
    splits = [
        6 // comm.world_size + (1 if r < 6 % comm.world_size else 0) for r in range(comm.world_size)
    ]
    out = module(idx, off, splits)
    if tuple(out.shape) != (splits[comm.rank], 2, 2):
        failures.append(f"rank {comm.rank}: auto-chunked output shape {tuple(out.shape)}")
    lookup = ShardedLookup(
        tables=list(module.tables),
        indices=idx,
        offsets=off,
        batch_splits=splits,
        tables_per_rank=module.tables_per_rank,
        dim=2,
        dtype=torch.float32,
    )
    with torch.no_grad():
        direct = embedding_all_to_all(comm, lookup, chunks=3)
    if not torch.equal(direct.index_select(1, module.order), out.detach()):
        failures.append(f"rank {comm.rank}: function form differs from the module")
    # Checked before any communication, so every rank raises (nobody is left waiting).
    bad_calls: dict[str, dict[str, Any]] = {
        "batch_splits needs": dict(batch_splits=[*splits, 1]),
        "mode must be one of": dict(mode="max"),
        "tables_per_rank says": dict(tables_per_rank=[t + 1 for t in module.tables_per_rank]),
    }
    for needle, change in bad_calls.items():
        try:
            embedding_all_to_all(comm, dataclasses.replace(lookup, **change))
            failures.append(f"rank {comm.rank}: no error for {change}")
        except ValueError as err:
            if needle not in str(err):
                failures.append(f"rank {comm.rank}: unclear error {err}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_embedding_all_to_all(pool: PoolFn, world: int) -> None:
    # 5 tables: uneven tables per rank; 2 tables: ranks 2.. own none.
    failures = [f for r in pool(world).run(grid, 5, timeout_s=180) for f in r]
    if world >= 3:
        failures += [f for r in pool(world).run(grid, 2, timeout_s=180) for f in r]
    assert not failures, "\n".join(failures[:8])


@pytest.mark.parametrize("world", [1, 3])
def test_embedding_function_and_errors(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(direct_call_and_errors, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])


def trial_choices() -> tuple[ChunkSchedule, ChunkSchedule, ChunkSchedule]:
    """fastest_by_trial on operators whose speed is known (a sleep), and the embedding choice."""
    comm = Communicator()
    fast = fastest_by_trial(
        comm, [2, 3], lambda k: time.sleep(0.002 if k == 2 else 0.03), runs=3, min_gain=0.05
    )
    slower = fastest_by_trial(
        comm, [2, 3], lambda k: time.sleep(0.002 if k == 1 else 0.03), runs=3, min_gain=0.05
    )
    module = ShardedEmbeddingBag([50] * 6, 4, comm)
    idx = [bags(t, 50, 64)[0] for t in module.local_tables]
    off = [bags(t, 50, 64)[1] for t in module.local_tables]
    chosen = module.chunks_for(idx, off, split_sizes(64, comm.world_size))
    code = 0 if chosen == BY_TABLE else int(chosen)  # by table as 0, to compare over ranks
    everyone = torch.tensor([code])
    comm.all_reduce(everyone, "max")
    return fast, slower, chosen if int(everyone) == code else -1


def test_chunks_chosen_by_trial(pool: PoolFn) -> None:
    for fast, slower, chosen in pool(3).run(trial_choices, timeout_s=120):
        assert (fast, slower) == (2, 1)  # the fastest wins; nothing beats the unfused: 1
        # The same on every rank, and the unfused operator or whole pieces per destination.
        assert chosen in (1, 2, 4, 6)


def prepared_gradients() -> list[str]:
    """The fused forward builds the backward's table gradients while it waits (when training),
    the backward uses them once, and a forward of other ids in between only makes the earlier
    backward build its own: every gradient equals the unfused module's, and the prepared
    buffer costs no communication (the same bytes and messages either way)."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    failures: list[str] = []
    rows, batch, dim = [7, 3, 10, 4, 6], 11, 3
    splits = splits_for(world, batch)
    mine = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
    stash = comm.owned(PreparedGradients)
    for config in (ChunkConfig(num_chunks=5), ChunkConfig(schedule=BY_TABLE)):
        where = f"rank {rank} chunks={config.fixed()}"
        fused = ShardedEmbeddingBag(rows, dim, comm, chunk_config=config)
        unfused = ShardedEmbeddingBag(rows, dim, comm, chunk_config=ChunkConfig(num_chunks=1))
        with torch.no_grad():
            for p, q, t in zip(fused.tables, unfused.tables, fused.local_tables, strict=True):
                full = torch.randint(
                    -3, 4, (rows[t], dim), generator=torch.Generator().manual_seed(t)
                )
                p.copy_(full)
                q.copy_(full)
        batches = []
        for seed in (0, 1):
            inputs = [bags(t + 7 * seed, rows[t], batch) for t in range(len(rows))]
            batches.append(
                (
                    [inputs[t][0] for t in fused.local_tables],
                    [inputs[t][1] for t in fused.local_tables],
                )
            )
        with torch.no_grad():
            fused(*batches[0], splits)
        if stash.ready:
            failures.append(f"{where}: a forward without grad prepared the backward")
        comm.stats.reset()
        outs = [fused(idx, off, splits) for idx, off in batches]  # two forwards, then backwards
        sent = comm.stats[LABEL].messages_sent, comm.stats[LABEL].bytes_sent
        if stash.ready != (world > 1):
            failures.append(f"{where}: prepared {stash.ready} after a training forward")
        g = torch.randint(
            -2, 3, (batch, len(rows), dim), generator=torch.Generator().manual_seed(5)
        )
        comm.stats.reset()
        # The later forward's backward first: it takes what that forward prepared; the earlier
        # one finds nothing prepared for its ids and builds its own.
        for out in reversed(outs):
            (out * g[mine]).sum().backward()
        back = comm.stats[LABEL].messages_recv, comm.stats[LABEL].bytes_recv
        if stash.ready:
            failures.append(f"{where}: the prepared gradients outlived their backward")
        if back != sent:
            failures.append(
                f"{where}: backward received {back} (messages, bytes), forward sent {sent}"
            )
        for idx, off in batches:
            (unfused(idx, off, splits) * g[mine]).sum().backward()
        for t, p, q in zip(fused.local_tables, fused.tables, unfused.tables, strict=True):
            if p.grad is None or q.grad is None or not torch.equal(p.grad, q.grad):
                failures.append(f"{where}: grad of table {t} differs from the unfused module's")
    return failures


@pytest.mark.parametrize("world", [1, 3])
def test_forward_prepares_the_backward_table_gradients(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(prepared_gradients, timeout_s=120) for f in r]
    assert not failures, "\n".join(failures[:8])

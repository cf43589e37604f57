"""Embedding + All-to-All: DLRM's sharded pooled lookup, fused with the exchange that follows it.

DLRM (Naumov et al. 2019) shards its embedding tables table-wise across ranks (model
parallelism) while its MLPs are data-parallel. Rank ``r`` owns ``T_r`` tables and receives the
indices of the *global* batch for them; it computes the pooled lookups (``EmbeddingBag``, sum or
mean) of all ``B`` samples, and an All-to-All sends the rows of rank ``j``'s samples
(``B_j`` of them) to rank ``j``, which then holds all ``T`` tables for its own samples.

Fused (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv 2305.06942, section 4.1):

1. Post the receives of every incoming block first.
2. For the destinations in ring order ``r+1, r+2, ..., r-1`` and the local rank last, compute the
   lookups of that destination's samples (cut into pieces when asked) and send each piece as
   soon as it is computed; the next piece is computed while it travels. Every rank sends to a
   different peer at each step, as in a pairwise exchange, so no link receives from two at once.
3. The local block is computed last: it never travels, so it hides the last transfers.

Layout. Rank ``r`` passes, for each of its tables ``t``, EmbeddingBag inputs for the global batch:
``indices[t]`` (1-D int64) and ``offsets[t]`` (``B`` starts, no trailing end). ``batch_splits``
lists ``B_j`` per rank and ``tables_per_rank`` lists ``T_j``. The output on rank ``r`` is
``[B_r, T, D]``, tables in rank-major order (rank 0's tables, then rank 1's, ...). A
``ShardedLookup`` carries these inputs (with ``D``, the dtype and the pooling mode) to every
function here.

Design notes: ``docs/fused.md``, "Embedding + All-to-All: by table, and its backward".
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from commfuse.comm import Communicator, Handle
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused import baselines
from commfuse.fused.chunking import (
    BY_TABLE,
    ChunkConfig,
    ChunkSchedule,
    agree_chunks,
    measure_overhead_us,
    split_ranges,
)
from commfuse.fused.fallback import fastest_by_trial
from commfuse.fused.table_gradients import PreparedGradients, TableGradients, bag_range

#: Stats label of the fused operator's point-to-point traffic (exact bytes and messages).
LABEL = "embedding_all_to_all"
MODES = ("sum", "mean")


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedLookup:
    """One rank's inputs to the embedding + All-to-All (layout in the module docstring): what
    the forward, its reference, its backward and the chunk choice all take, so that the eight of
    them travel together and are checked in one place (``check``).

    Nothing is copied: the lists and tensors are the caller's, and frozen only means the fields
    are not rebound. ``eq=False`` because comparing field by field would compare tensors, whose
    ``==`` has no truth value; two lookups are the same only if they are the same object.

    The fields are in the order of ``torch.ops.commfuse.embedding_all_to_all``'s first eight
    arguments (``fused/ops.py``), which passes them flattened (an operator takes only tensors
    and plain values) and rebuilds the lookup from them positionally."""

    tables: list[torch.Tensor]
    """This rank's tables, ``T_r`` of them (none is allowed): 2-D ``[rows_t, D]``, all of the
    same ``D`` and dtype."""
    indices: list[torch.Tensor]
    """Per local table, the ids its bags look up for every sample of the *global* batch: 1-D
    int64 (or int32, with int32 offsets)."""
    offsets: list[torch.Tensor]
    """Per local table, where each of the ``B`` bags of the global batch starts in its indices:
    ``B`` entries, no trailing end (a bag runs to the next start, the last to the end)."""
    batch_splits: list[int]
    """``B_j``, the samples of rank ``j``, one entry per rank (0 allowed), rank-major: the global
    batch is their sum, and rank ``r`` receives the rows of its own ``B_r``."""
    tables_per_rank: list[int]
    """``T_j``, the tables rank ``j`` owns, one entry per rank: the output is
    ``[B_r, sum(T_j), D]``, rank 0's tables first."""
    dim: int
    """``D``, the embedding dimension. Given rather than read from the tables because a rank
    may own none, and it still receives every table's rows."""
    dtype: torch.dtype
    """The tables' dtype (the output's), given for the same reason."""
    mode: str = "sum"
    """How a bag pools its rows: ``"sum"`` or ``"mean"`` (``MODES``)."""

    @property
    def device(self) -> torch.device:
        """Where the tables (else the ids) live: the device of every buffer built for them."""
        held = self.tables or self.indices
        return held[0].device if held else torch.device("cpu")

    @property
    def sample_starts(self) -> list[int]:
        """Where each rank's samples start in the global batch."""
        return list(itertools.accumulate(self.batch_splits, initial=0))[:-1]

    @property
    def table_starts(self) -> list[int]:
        """Where each rank's tables start in the output's rank-major table order."""
        return list(itertools.accumulate(self.tables_per_rank, initial=0))[:-1]

    def check(self, comm: Communicator) -> int:
        """ValueError naming the problem; returns the global batch size.

        Checks only this rank's inputs against ``comm``'s size and rank, before anything is
        sent: a rank that raises here has not left a peer waiting on it."""
        tables, indices, offsets = self.tables, self.indices, self.offsets
        batch_splits, tables_per_rank, mode = self.batch_splits, self.tables_per_rank, self.mode
        world = comm.world_size
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if len(batch_splits) != world or any(b < 0 for b in batch_splits):
            raise ValueError(
                f"batch_splits needs {world} non-negative entries (one per rank), got {batch_splits}"
            )
        if len(tables_per_rank) != world or any(t < 0 for t in tables_per_rank):
            raise ValueError(
                f"tables_per_rank needs {world} non-negative entries, got {tables_per_rank}"
            )
        if tables_per_rank[comm.rank] != len(tables):
            raise ValueError(
                f"rank {comm.rank} holds {len(tables)} tables but tables_per_rank says {tables_per_rank[comm.rank]}"
            )
        if len(indices) != len(tables) or len(offsets) != len(tables):
            raise ValueError(
                f"need one indices and one offsets tensor per local table: {len(tables)} tables, "
                f"{len(indices)} indices, {len(offsets)} offsets"
            )
        batch = sum(batch_splits)
        for t, (table, idx, off) in enumerate(zip(tables, indices, offsets, strict=True)):
            if (
                table.dim() != 2
                or table.shape[1] != tables[0].shape[1]
                or table.dtype != tables[0].dtype
            ):
                raise ValueError(
                    f"local table {t} must be 2-D with the same dim and dtype as table 0, got {tuple(table.shape)} {table.dtype}"
                )
            if off.dim() != 1 or off.numel() != batch:
                raise ValueError(
                    f"offsets[{t}] must hold one start per sample of the global batch ({batch}), got {tuple(off.shape)}"
                )
            if (
                idx.dim() != 1
                or idx.dtype not in (torch.int64, torch.int32)
                or off.dtype != idx.dtype
            ):
                raise ValueError(f"indices[{t}] and offsets[{t}] must be 1-D int64 (or both int32)")
        return batch

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Pooled lookups of samples ``[start, stop)`` of the global batch in every local table:
        ``[stop - start, T_r, D]`` (``T_r = 0`` when this rank owns no table)."""
        columns = [self.bags(t, start, stop) for t in range(len(self.tables))]
        if not columns:
            # No table: the shape still says how many samples, and the dim their rows would have.
            return torch.empty((stop - start, 0, self.dim), dtype=self.dtype, device=self.device)
        return torch.stack(columns, dim=1).reshape(stop - start, len(self.tables), self.dim)

    def bags(self, t: int, start: int, stop: int) -> torch.Tensor:
        """Local table ``t``'s pooled lookups of samples ``[start, stop)``: ``[stop - start, D]``."""
        idx, off = self.indices[t], self.offsets[t]
        lo, hi = bag_range(off, idx.numel(), start, stop)
        return F.embedding_bag(idx[lo:hi], self.tables[t], off[start:stop] - lo, mode=self.mode)


def _empty_blocks(
    comm: Communicator, rows: int, tables_per_rank: list[int], dim: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    return [torch.empty((rows, t, dim), dtype=dtype, device=comm.device) for t in tables_per_rank]


def _unfused_buffers(
    comm: Communicator, lookup: ShardedLookup, send: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The unfused All-to-All's arguments for ``send`` (every lookup, ``[B, T_r, D]``): the
    receive buffer, the flat send buffer, and the element counts received from and sent to
    each rank (``all_to_all``'s ``out_splits`` and ``in_splits``)."""
    rank, splits, dim = comm.rank, lookup.batch_splits, lookup.dim
    in_splits = [b * len(lookup.tables) * dim for b in splits]
    out_splits = [splits[rank] * t * dim for t in lookup.tables_per_rank]
    recv = torch.empty(sum(out_splits), dtype=lookup.dtype, device=send.device)
    return recv, send.contiguous().view(-1), out_splits, in_splits


def check_schedule(chunks: ChunkSchedule) -> None:
    """ValueError unless ``chunks`` is a count >= 1 or ``BY_TABLE``."""
    if chunks != BY_TABLE and (
        isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1
    ):
        raise ValueError(f"chunks must be >= 1, or {BY_TABLE!r}, got {chunks!r}")


def embedding_all_to_all(
    comm: Communicator,
    lookup: ShardedLookup,
    *,
    chunks: ChunkSchedule = 2,
    prepare_backward: bool = False,
) -> torch.Tensor:
    """The fused operator (module docstring). ``chunks=1`` is the unfused reference; ``chunks >= 2``
    pipelines destination by destination, each destination's rows cut into
    ``ceil(chunks / (P - 1))`` pieces; ``chunks=BY_TABLE`` pipelines table by table.

    ``prepare_backward`` (training): once every message is sent, and before waiting for the
    last ones, build the table gradients' buffer and expanded offsets for
    ``embedding_all_to_all_backward`` (``table_gradients.PreparedGradients``), work the
    backward would otherwise do. Ignored by the unfused reference (``chunks=1``), which has no
    wait to fill."""
    check_schedule(chunks)
    lookup.check(comm)
    rank, world = comm.rank, comm.world_size
    if chunks == 1 or world == 1:
        return embedding_all_to_all_reference(comm, lookup)
    if chunks == BY_TABLE:
        return _by_table(comm, lookup, prepare_backward)
    assert isinstance(chunks, int)
    batch_splits, dim = lookup.batch_splits, lookup.dim
    pieces = -(-chunks // (world - 1))
    starts = lookup.sample_starts
    mine = batch_splits[rank]
    blocks = _empty_blocks(comm, mine, lookup.tables_per_rank, dim, lookup.dtype)
    handles: list[Handle] = []
    for step in range(1, world):
        src = (rank - step) % world
        for tag, (lo, hi) in enumerate(split_ranges(mine, pieces)):
            handles.append(comm.irecv(blocks[src][lo:hi], src, tag=tag, label=LABEL))
    for step in range(1, world):
        dst = (rank + step) % world
        for tag, (lo, hi) in enumerate(split_ranges(batch_splits[dst], pieces)):
            piece = lookup.rows(starts[dst] + lo, starts[dst] + hi).contiguous()
            handles.append(comm.isend(piece, dst, tag=tag, label=LABEL))
    blocks[rank].copy_(lookup.rows(starts[rank], starts[rank] + mine))
    if prepare_backward:
        _prepare(comm, lookup)  # while the last pieces travel
    for handle in handles:
        handle.wait()
    return torch.cat(blocks, dim=1)


def _prepare(comm: Communicator, lookup: ShardedLookup) -> None:
    """Build the backward's table gradients now (``PreparedGradients``)."""
    comm.owned(PreparedGradients).put(lookup.tables, lookup.indices, lookup.offsets, lookup.mode)


def _take(comm: Communicator, lookup: ShardedLookup) -> TableGradients:
    """The table gradients the forward prepared for these inputs, else new ones."""
    return comm.owned(PreparedGradients).take(
        lookup.tables, lookup.indices, lookup.offsets, lookup.mode
    )


def _by_table(comm: Communicator, lookup: ShardedLookup, prepare_backward: bool) -> torch.Tensor:
    """The by-table schedule (module docstring): table by table, each one's column of the global
    batch computed once and its slices sent to every peer while the next table is looked up."""
    rank, world = comm.rank, comm.world_size
    splits, per_rank, dim = lookup.batch_splits, lookup.tables_per_rank, lookup.dim
    starts, table_starts = lookup.sample_starts, lookup.table_starts
    mine = splits[rank]
    # One table-major landing buffer, [T, B_r, D] in rank-major table order: every message (one
    # source's table) lands in its own contiguous slice, so the output costs one transposing
    # copy at the end (a buffer per source cost a concatenation more: 8 MB at 64-dim x 32 tables).
    landing = torch.empty((sum(per_rank), mine, dim), dtype=lookup.dtype, device=comm.device)
    handles: list[Handle] = []
    if mine:
        for step in range(1, world):
            src = (rank - step) % world
            for t in range(per_rank[src]):
                target = landing[table_starts[src] + t]
                handles.append(comm.irecv(target, src, tag=t, label=LABEL))
    for t in range(len(lookup.tables)):
        # Nothing can be sent before the first lookup, so the first table is looked up one
        # destination's samples at a time, each sent as soon as it is computed: the first
        # message leaves after 1/P of that table's lookups instead of all of them. Each bag is
        # summed alone either way, so the rows are the same bit for bit. The other tables are
        # looked up whole (one call, rows hot in cache) and sent as slices of that column.
        column = None if t == 0 else lookup.bags(t, 0, lookup.offsets[t].numel())  # [B, D]
        for step in range(1, world):
            dst = (rank + step) % world
            if splits[dst]:
                part = _samples(lookup, t, column, starts[dst], splits[dst])
                handles.append(comm.isend(part, dst, tag=t, label=LABEL))
        if mine:
            landing[table_starts[rank] + t] = _samples(lookup, t, column, starts[rank], mine)
    if prepare_backward:
        _prepare(comm, lookup)  # while the peers' rows travel
    for handle in handles:
        handle.wait()
    # [T, B_r, D] -> [B_r, T, D], as the reference returns.
    return landing.permute(1, 0, 2).contiguous()


def _samples(
    lookup: ShardedLookup, t: int, column: torch.Tensor | None, start: int, count: int
) -> torch.Tensor:
    """Table ``t``'s pooled rows of samples ``[start, start + count)``: contiguous rows of its
    looked-up ``column``, or, without one, looked up now."""
    if column is not None:
        return column[start : start + count]
    return lookup.bags(t, start, start + count)


def embedding_all_to_all_reference(
    comm: Communicator, lookup: ShardedLookup, *, algo: str | None = None
) -> torch.Tensor:
    """Unfused: every lookup, then one All-to-All (``algo`` of commfuse.collectives.all_to_all,
    by default ``baselines.ALL_TO_ALL``; "pairwise" counts exact point-to-point bytes, "native"
    is gloo's own)."""
    from commfuse.collectives import all_to_all

    batch = lookup.check(comm)
    rank, world = comm.rank, comm.world_size
    recv, flat, out_splits, in_splits = _unfused_buffers(comm, lookup, lookup.rows(0, batch))
    all_to_all(comm, recv, flat, out_splits, in_splits, algo=algo or baselines.ALL_TO_ALL)
    mine = lookup.batch_splits[rank]
    blocks = [
        part.view(mine, t, lookup.dim)
        for part, t in zip(torch.split(recv, out_splits), lookup.tables_per_rank, strict=True)
    ]
    return torch.cat(blocks, dim=1) if world > 1 else blocks[0].clone()


def embedding_all_to_all_backward(
    comm: Communicator, lookup: ShardedLookup, grad_out: torch.Tensor, *, chunks: ChunkSchedule = 2
) -> list[torch.Tensor]:
    """Gradients of the local tables (module docstring) for the gradient ``grad_out`` of the
    forward's output (``[B_r, T, D]``): the reverse All-to-All, overlapped with the
    accumulation. Sends the same bytes as the forward, in the other direction."""
    rank, world = comm.rank, comm.world_size
    tables = lookup.tables
    batch_splits, tables_per_rank = lookup.batch_splits, lookup.tables_per_rank
    dim = grad_out.shape[2] if grad_out.dim() == 3 else 0
    if chunks == BY_TABLE and world > 1:
        return _backward_by_table(comm, lookup, grad_out).result(tables)
    starts, table_starts = lookup.sample_starts, lookup.table_starts
    mine = batch_splits[rank]
    pieces = 1 if world == 1 or not isinstance(chunks, int) else -(-chunks // (world - 1))
    incoming: list[tuple[Handle, int, torch.Tensor]] = []
    for step in range(1, world):
        src = (rank + step) % world  # the ranks whose samples I looked up, in the forward's order
        buf = grad_out.new_empty((batch_splits[src], len(tables), dim))
        for tag, (lo, hi) in enumerate(split_ranges(batch_splits[src], pieces)):
            handle = comm.irecv(buf[lo:hi], src, tag=tag, label=LABEL)
            incoming.append((handle, starts[src] + lo, buf[lo:hi]))
    outgoing: list[Handle] = []
    for step in range(1, world):
        dst = (rank - step) % world
        block = grad_out[
            :, table_starts[dst] : table_starts[dst] + tables_per_rank[dst]
        ].contiguous()
        for tag, (lo, hi) in enumerate(split_ranges(mine, pieces)):
            outgoing.append(comm.isend(block[lo:hi], dst, tag=tag, label=LABEL))
    # The gradient buffer (zeroed) and the expanded offsets, unless the forward prepared them,
    # are built while the blocks travel.
    grads = _take(comm, lookup)
    own = grad_out[:, table_starts[rank] : table_starts[rank] + tables_per_rank[rank]]
    grads.add(starts[rank], own)  # while the remote blocks travel
    for handle, start, piece in incoming:
        handle.wait()
        grads.add(start, piece)
    for handle in outgoing:
        handle.wait()
    return grads.result(tables)


def _backward_by_table(
    comm: Communicator, lookup: ShardedLookup, grad_out: torch.Tensor
) -> TableGradients:
    """The by-table schedule's backward: each rank sends every owner the gradient column of
    each of its tables (table by table, so owners can start on their first table), and an owner
    accumulates table by table, its own samples first, then ranks ``r+1, r+2, ...`` as the
    sample-cut backward does, so each row sums the same terms in the same order. One table's
    rows at a time stay in cache where a block of every table did not."""
    rank, world = comm.rank, comm.world_size
    splits, per_rank = lookup.batch_splits, lookup.tables_per_rank
    dim = grad_out.shape[2]
    starts, table_starts = lookup.sample_starts, lookup.table_starts
    mine, local = splits[rank], len(lookup.tables)
    sources = [(rank + step) % world for step in range(1, world)]  # the forward's order
    landing = {src: grad_out.new_empty((local, splits[src], dim)) for src in sources}
    incoming: dict[tuple[int, int], Handle] = {}
    for src in sources:
        if splits[src]:
            for t in range(local):
                incoming[t, src] = comm.irecv(landing[src][t], src, tag=t, label=LABEL)
    # One transposing copy, [B_r, T, D] -> [T, B_r, D], makes every table's column one
    # contiguous block: each message is then a view, where a copy per column read the whole
    # gradient in strides of D once per table and allocated a buffer per message.
    columns = grad_out.transpose(0, 1).contiguous()
    outgoing: list[Handle] = []
    if mine:
        for t in range(max(per_rank)):
            for step in range(1, world):
                dst = (rank - step) % world
                if t < per_rank[dst]:
                    column = columns[table_starts[dst] + t]  # [B_r, D], contiguous
                    outgoing.append(comm.isend(column, dst, tag=t, label=LABEL))
    # The gradient buffer (zeroed) and the expanded offsets, unless the forward prepared them,
    # are built while the columns travel.
    grads = _take(comm, lookup)
    for t in range(local):
        grads.add_table(t, starts[rank], columns[table_starts[rank] + t])
        for src in sources:
            if splits[src]:
                incoming[t, src].wait()
                grads.add_table(t, starts[src], landing[src][t])
    for handle in outgoing:
        handle.wait()
    return grads


def measure(comm: Communicator, lookup: ShardedLookup) -> tuple[float, float]:
    """(compute_us, comm_us) of one unfused run: all lookups alone, then the All-to-All alone."""
    from commfuse.collectives import all_to_all

    batch = sum(lookup.batch_splits)
    start = now(comm.device)
    send = lookup.rows(0, batch)
    compute_us = elapsed_us(start, comm.device)
    recv, flat, out_splits, in_splits = _unfused_buffers(comm, lookup, send)
    start = now(comm.device)
    all_to_all(comm, recv, flat, out_splits, in_splits, algo=baselines.ALL_TO_ALL)
    return compute_us, elapsed_us(start, comm.device)


def choose_chunks_for(
    comm: Communicator,
    lookup: ShardedLookup,
    *,
    config: ChunkConfig,
    backward: bool = True,
    trial_runs: int = 5,
) -> ChunkSchedule:
    """The ``chunks`` of ``embedding_all_to_all`` for these inputs, the same on every rank
    (``backward``: for training, where the reverse exchange runs with the same ``chunks``).

    The cost model (measured ``C``, ``M`` and per-chunk overhead, without its ``min_gain``
    margin, which it missed by noise from one run to the next on a DLRM step) decides whether
    chunking can pay at all; if it can, the candidates 1, 2 and 3 pieces per destination (``chunks`` =
    ``P - 1``, ``2 (P - 1)``, ``3 (P - 1)``), the by-table schedule (``BY_TABLE``, its reverse
    exchange table by table too) and ``chunks = 1`` are timed, forward and (``backward``)
    backward as a training step runs them (``chunks`` cuts the reverse exchange too), interleaved, and
    the fastest is kept (``fallback.fastest_by_trial``). The model alone counts chunks, not
    the pieces they become: on a DLRM step (4 hosts at 1 Gbit/s) its choice flipped between
    ``k = 3`` (one piece per destination: step 0.91-0.94 of unfused) and ``k = 4`` (two pieces:
    0.84-0.86) from one run to the next. Every rank must call it alike; it runs the operator a
    few times."""
    world = comm.world_size
    limit = max(sum(lookup.batch_splits), 1)
    if config.schedule == BY_TABLE and world > 1:
        return BY_TABLE
    if config.num_chunks is not None or world == 1:
        return max(1, min(config.num_chunks or 1, limit))
    with torch.no_grad():
        measure(comm, lookup)  # the first run pays one-off costs
        compute_us, comm_us = measure(comm, lookup)
        overhead = config.overhead_us
        if overhead is None:
            overhead = measure_overhead_us(comm)
        # The model without its margin: only "can chunking pay at all?" (no computation to hide,
        # or overheads beyond it); how much it pays is for the trial to say.
        loose = dataclasses.replace(config, min_gain=0.0)
        chunks = agree_chunks(comm, compute_us, comm_us, overhead, loose, limit=limit)
        if chunks == 1 or trial_runs < 1:
            return chunks
        cap = min(config.max_chunks, limit)
        candidates: list[ChunkSchedule] = [
            p * (world - 1) for p in (1, 2, 3) if p * (world - 1) <= cap
        ] or [chunks]
        candidates.append(BY_TABLE)
        grad = torch.ones(
            (lookup.batch_splits[comm.rank], sum(lookup.tables_per_rank), lookup.dim),
            dtype=lookup.dtype,
            device=comm.device,
        )

        def forward_and_backward(k: ChunkSchedule) -> None:
            # Both directions, as a training step runs them: ``k`` cuts the backward too.
            embedding_all_to_all(comm, lookup, chunks=k)
            if backward:
                embedding_all_to_all_backward(comm, lookup, grad, chunks=k)

        forward_and_backward(candidates[0])  # opens the pairs' connections
        return fastest_by_trial(
            comm, candidates, forward_and_backward, runs=trial_runs, min_gain=config.min_gain
        )

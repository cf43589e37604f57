"""GEMM/GEMV + AllReduce: the row-parallel linear layer of tensor parallelism, fused.

In a row-parallel linear (Megatron-LM, Shoeybi et al. 2019) each rank holds the columns
``x[:, K_r]`` of the input and ``W[:, K_r]`` of the weight, computes the partial product
``x[:, K_r] @ W[:, K_r]^T``, and the ranks sum the partials with an AllReduce, which unfused
sits on the critical path. Fused (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv
2305.06942, section 4.2), an AllReduce being a ReduceScatter followed by an AllGather:

1. **Rows (a GEMM; at least P rows).** The rows are cut into ``g = ceil(k / P)`` groups, each
   run as the fused GEMM + ReduceScatter ring of ``gemm_reduce_scatter.py`` (at ring step ``s``
   this rank computes its partial of block ``r - 1 - s`` while the running sum of that block
   arrives from ``r - 1``); each rank then posts its summed block to every other rank (a direct
   all-gather), which travels while the next group's ring computes.
2. **Row blocks in two levels** (``schedule="blocks"``, the default where the ranks fill several
   hosts of several ranks): each of ``k`` blocks' GEMM writes its rows in place, then every
   earlier block's all-reduce moves one phase on (``two_level_all_reduce.py``).
3. **Columns (a GEMV: fewer rows than P).** The output features are cut into ``k`` blocks, each
   reduced by ``DirectAllReduce`` while the next block is computed.

Bytes: in one level each rank sends ``2 (P - 1) / P`` of the output, what a ring all-reduce of
the unfused output sends; in two levels ``2 ((L - 1) / L)`` of it inside the host and
``2 ((H - 1) / H) / L`` across hosts. ``choose_chunks_for`` picks ``k``, and runs the unfused
operator (``k = 1``) unless a timed trial confirms the chunks (``fallback.py``). Backward: the
output is replicated, so the AllReduce's backward is the identity and both gradients are
local (no collective).

Design notes: ``docs/fused.md``, "GEMM + AllReduce: schedules, sums, choosing and tuning k".
"""

from __future__ import annotations

import math
from typing import Final, Literal

import torch

from commfuse.comm import Communicator, Handle, check_consistent
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused import baselines
from commfuse.fused.chunking import (
    ChunkConfig,
    measure_overhead_us,
    split_ranges,
    split_sizes,
)
from commfuse.fused.direct_all_reduce import DirectAllReduce
from commfuse.fused.direct_all_reduce import sent_bytes as direct_sent_bytes
from commfuse.fused.fallback import choose_fused_chunks, confirm_by_trial
from commfuse.fused.two_level_all_reduce import TwoLevelAllReduce
from commfuse.fused.two_level_all_reduce import sent_bytes as two_level_sent_bytes

RowSchedule = Literal["ring", "blocks"]
"""How the row path reduces (module docstring): ``"ring"``, a fused GEMM + ReduceScatter ring
per row group; ``"blocks"``, direct phases per row block, in two levels where the ranks fill
several hosts."""
#: Row blocks of the ``"blocks"`` schedule that the automatic choice tries (``choose_chunks_for``).
BLOCK_CHUNKS: Final = 2
#: The row schedules, in the order a benchmark times them.
ROW_SCHEDULES: Final[tuple[RowSchedule, ...]] = ("ring", "blocks")

#: Stats label of the fused pipeline's point-to-point traffic (exact bytes and messages); the
#: unfused reference's native all-reduce counts its payload under "all_reduce".
LABEL = "gemm_all_reduce"


def check_shapes(x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError unless ``x[..., K] @ weight[N, K]^T`` is well formed."""
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features_shard), got {tuple(weight.shape)}"
        )
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dimension ({x.shape[-1] if x.dim() else 'scalar'}) must equal the weight's "
            f"in_features shard ({weight.shape[1]})"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}; cast one of them")


def check_same_output(comm: Communicator, x: torch.Tensor, weight: torch.Tensor) -> None:
    """InconsistentInputError (a ValueError) if ranks would all-reduce outputs of different shapes."""
    rows = math.prod(x.shape[:-1])
    meta = torch.empty((rows, weight.shape[0]), dtype=x.dtype, device="meta")
    check_consistent(comm, meta, "gemm_all_reduce output")


def gemm_all_reduce_reference(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    ranks_per_host: int | None = None,
) -> torch.Tensor:
    """The unfused operator: the whole GEMM, then one AllReduce (sum) of the result, the
    fastest unfused all-reduce commfuse has for the layout (``baselines.all_reduce_algo``:
    gloo's ring, or the hierarchical all-reduce where the ranks fill several hosts of several
    ranks). ``ranks_per_host``: the host layout, as ``gemm_all_reduce``'s."""
    check_shapes(x, weight)
    out = torch.matmul(x, weight.t())
    reference_all_reduce(comm, out, ranks_per_host)
    return out


def reference_all_reduce(
    comm: Communicator, out: torch.Tensor, ranks_per_host: int | None = None
) -> None:
    """The reference's all-reduce (sum) of ``out`` in place: ``baselines.all_reduce_algo``'s
    choice for its size and the layout (``ranks_per_host`` as ``gemm_all_reduce``'s)."""
    from commfuse.collectives import all_reduce
    from commfuse.collectives.hierarchical import ranks_per_host_of

    local = ranks_per_host_of(comm, ranks_per_host)
    algo = baselines.all_reduce_algo(out.numel() * out.element_size(), comm.world_size, local)
    if algo == "hierarchical":
        all_reduce(comm, out, "sum", algo=algo, ranks_per_host=local)
    else:
        comm.all_reduce(out, "sum")


def gemm_all_reduce(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunks: int,
    schedule: RowSchedule | None = None,
    ranks_per_host: int | None = None,
) -> torch.Tensor:
    """``all_reduce_sum(x @ weight^T)`` computed and reduced in ``chunks`` pieces (see the module
    docstring). ``chunks=1`` is the unfused reference; every rank must pass the same ``chunks``,
    ``schedule`` and ``ranks_per_host``.

    Args:
        comm: the tensor-parallel group.
        x: ``[..., K_r]``, this rank's input-feature shard.
        weight: ``[N, K_r]``, the matching columns of the weight.
        chunks: pieces (row groups of the ring, row blocks, or output-feature blocks of a GEMV).
        schedule: the row path's schedule (``RowSchedule``); None: ``default_schedule``. A
            GEMV has one schedule.
        ranks_per_host: the host layout (ranks are host-major); None:
            ``CommConfig.ranks_per_host``, else one rank per host.

    Returns:
        ``[..., N]``, the sum over ranks, the same on every rank.

    Raises:
        ValueError: shapes that do not multiply, ``chunks < 1``, an unknown ``schedule``, a
            ``ranks_per_host`` that does not divide the group.
    """
    check_shapes(x, weight)
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if schedule is None:
        schedule = default_schedule(comm, ranks_per_host)
    if schedule not in ROW_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(ROW_SCHEDULES)}, got {schedule!r}")
    lead = x.shape[:-1]
    rows, cols = math.prod(lead), weight.shape[0]
    x2 = x.reshape(rows, x.shape[-1])  # explicit rows: an empty shard has K = 0
    if chunks == 1 or comm.world_size == 1:
        return gemm_all_reduce_reference(comm, x, weight, ranks_per_host=ranks_per_host)
    if rows >= comm.world_size:
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        if schedule == "ring":
            _ring_then_gather(comm, x2, weight, out, row_groups(rows, chunks, comm.world_size))
        else:
            _blocks(comm, x2, weight, out, split_ranges(rows, chunks), ranks_per_host)
        return out.reshape(*lead, cols)
    # Few rows (a GEMV): cut the output features instead; each block is its own buffer.
    reducer = DirectAllReduce(comm, LABEL)
    pieces = []
    for start, stop in split_ranges(cols, chunks):
        pieces.append(torch.matmul(x2, weight[start:stop].t()).contiguous())
        # Keep one piece's reduce-scatter in flight while the next piece is computed.
        reducer.start(pieces[-1])
        if reducer.in_flight > 1:
            reducer.advance()
    reducer.finish()
    return torch.cat(pieces, dim=1).reshape(*lead, cols)


def default_schedule(comm: Communicator, ranks_per_host: int | None = None) -> RowSchedule:
    """``"blocks"`` where the ranks fill several hosts of several ranks each (the two-level
    reduction crosses each host link with fewer bytes than any flat one), else ``"ring"``."""
    from commfuse.collectives.hierarchical import ranks_per_host_of

    local = ranks_per_host_of(comm, ranks_per_host)
    return "blocks" if 1 < local < comm.world_size else "ring"


def _blocks(
    comm: Communicator,
    x2: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    blocks: list[tuple[int, int]],
    ranks_per_host: int | None,
) -> None:
    """The ``"blocks"`` schedule (module docstring): each row block's GEMM writes its rows of
    ``out`` in place, then every earlier block moves one phase on and the new one starts."""
    from commfuse.collectives.hierarchical import host_levels, ranks_per_host_of

    local = ranks_per_host_of(comm, ranks_per_host)
    subs: tuple[Communicator, ...] = ()
    if local == 1:  # one level: no sub-groups, the traffic on comm itself
        reducer = TwoLevelAllReduce(None, comm, LABEL)
    elif local == comm.world_size:
        reducer = TwoLevelAllReduce(comm, None, LABEL)
    else:
        subs = host_levels(comm, local)
        for sub in subs:
            sub.stats.reset()
        reducer = TwoLevelAllReduce(subs[0], subs[1], LABEL)
    w_t = weight.t()
    for start, stop in blocks:
        torch.matmul(x2[start:stop], w_t, out=out[start:stop])
        reducer.advance()
        reducer.start(out[start:stop])
    reducer.finish()
    for sub in subs:  # the sub-groups' messages are this operator's
        comm.stats[LABEL].add(sub.stats[LABEL])
    if subs:
        comm.stats[CROSS_LABEL].add(subs[1].stats[LABEL])


#: Stats label of the ``"blocks"`` schedule's cross-host messages where it runs in two levels
#: (they are counted under ``LABEL`` too).
CROSS_LABEL = f"{LABEL}.across_hosts"

#: Tag of the all-gather messages (the ring's own tags are its steps, 0 .. P - 1).
_GATHER_TAG = 1 << 16


def row_groups(rows: int, chunks: int, world: int) -> list[tuple[int, int]]:
    """The row groups of the ring path: ``ceil(chunks / P)`` of them, at most one per P rows."""
    groups = max(1, min(math.ceil(chunks / world), rows // world))
    return list(split_ranges(rows, groups))


def _ring_then_gather(
    comm: Communicator,
    x2: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    groups: list[tuple[int, int]],
) -> None:
    """The row path (module docstring): per group, the fused GEMM + ReduceScatter ring, then this
    rank's summed block posted to every rank; every gather is waited for at the end."""
    from commfuse.fused.gemm_reduce_scatter import gemm_reduce_scatter

    rank, world = comm.rank, comm.world_size
    gathers: list[Handle] = []
    for start, stop in groups:
        splits = split_sizes(stop - start, world)
        offsets = [start + sum(splits[:j]) for j in range(world)]
        mine = gemm_reduce_scatter(
            comm, x2[start:stop], weight, splits=splits, chunks=world, label=LABEL
        )
        block = out[offsets[rank] : offsets[rank] + splits[rank]]
        block.copy_(mine)
        for step in range(1, world):
            src, dst = (rank - step) % world, (rank + step) % world
            if splits[src]:
                target = out[offsets[src] : offsets[src] + splits[src]]
                gathers.append(comm.irecv(target, src, tag=_GATHER_TAG, label=LABEL))
            if splits[rank]:
                gathers.append(comm.isend(block, dst, tag=_GATHER_TAG, label=LABEL))
    for handle in gathers:
        handle.wait()


def sent_bytes(
    rows: int,
    cols: int,
    chunks: int,
    world: int,
    rank: int,
    element_size: int,
    *,
    schedule: RowSchedule = "ring",
    ranks_per_host: int = 1,
) -> int:
    """Bytes this rank sends in ``gemm_all_reduce(..., chunks)`` (``chunks > 1``, ``world > 1``)
    for a ``[rows, cols]`` output. Ring: every block of each group but its own, then its own
    block ``P - 1`` times (the gather); blocks: ``sum(two_level_all_reduce.sent_bytes)`` over
    the row blocks; a GEMV's columns: ``direct_all_reduce.sent_bytes``."""
    if rows < world:
        numels = [n * rows for n in split_sizes(cols, chunks) if n]
        return direct_sent_bytes(numels, world, rank, element_size)
    if schedule == "blocks":
        numels = [(stop - start) * cols for start, stop in split_ranges(rows, chunks)]
        hosts = world // ranks_per_host
        return sum(two_level_sent_bytes(numels, hosts, ranks_per_host, rank, element_size))
    total = 0
    for start, stop in row_groups(rows, chunks, world):
        splits = split_sizes(stop - start, world)
        total += (stop - start - splits[rank] + (world - 1) * splits[rank]) * cols
    return total * element_size


def gemm_all_reduce_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight): local, since the AllReduce's backward is the identity."""
    rows = math.prod(x.shape[:-1])
    g2 = grad_out.reshape(rows, weight.shape[0])
    x2 = x.reshape(rows, x.shape[-1])
    grad_x = torch.matmul(g2, weight).reshape(x.shape)
    grad_w = torch.matmul(g2.t(), x2)
    return grad_x, grad_w


def measure(comm: Communicator, x: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """(compute_us, comm_us) of one unfused run: the GEMM alone, then the AllReduce alone."""
    start = now(comm.device)
    out = torch.matmul(x, weight.t())
    compute_us = elapsed_us(start, comm.device)
    start = now(comm.device)
    comm.all_reduce(out, "sum")
    return compute_us, elapsed_us(start, comm.device)


def measure_fused_comm_us(comm: Communicator, out: torch.Tensor) -> float:
    """Time of the fused path's own transport on the whole output, in one piece: the ``M`` the
    pipeline really pays, which can differ from gloo's all-reduce (``fallback.py``). Rows: a ring
    reduce-scatter and all-gather (commfuse's ring all-reduce moves the same bytes the same way);
    a GEMV's columns: ``DirectAllReduce``."""
    from commfuse.collectives import all_reduce

    buf = out.reshape(math.prod(out.shape[:-1]), out.shape[-1]).contiguous().clone()
    start = now(comm.device)
    if buf.shape[0] >= comm.world_size:
        all_reduce(comm, buf, "sum", algo="ring")
    else:
        reducer = DirectAllReduce(comm, LABEL)
        reducer.start(buf.view(-1))
        reducer.finish()
    return elapsed_us(start, comm.device)


def cached_chunks(
    cache: dict[tuple[int, torch.dtype], int],
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    config: ChunkConfig,
) -> int:
    """``config.num_chunks``, or ``choose_chunks_for`` on first use, for inputs with the rows
    and dtype of ``x``, remembered in ``cache`` (a layer's, one entry per input shape)."""
    key = (math.prod(x.shape[:-1]), x.dtype)
    if key not in cache:
        if config.num_chunks is not None:
            cache[key] = config.num_chunks
        else:
            check_same_output(comm, x, weight)
            # Times gloo's all-reduce (unfused) and the pipeline's own transport apart, and
            # confirms a chunked choice by a timed trial (fused/fallback.py).
            cache[key] = choose_chunks_for(comm, x.detach(), weight.detach(), config)
    return cache[key]


def choose_chunks_for(
    comm: Communicator,
    x: torch.Tensor,
    weight: torch.Tensor,
    config: ChunkConfig,
    *,
    trial_runs: int = 5,
) -> int:
    """The number of chunks for ``gemm_all_reduce(comm, x, weight)``, the same on every rank:
    measured C, gloo's M for the unfused path, the fused path's own M, the model,
    then a timed trial of the chosen ``k`` against the unfused operator (``fallback.py``). Falls
    back to 1 (the unfused operator, the reference) whenever fusion does not measurably pay.
    Every rank must call it with the same shapes; it runs the operator a few times."""
    rows = math.prod(x.shape[:-1])
    limit = max(rows, weight.shape[0])
    if config.num_chunks is not None or comm.world_size == 1:
        return max(1, min(config.num_chunks or 1, limit))
    if rows >= comm.world_size and default_schedule(comm) == "blocks":
        # Two levels: the blocks move fewer bytes across hosts than the unfused all-reduce, so
        # the model's one M does not describe them; the timed trial alone decides.
        with torch.no_grad():
            for _ in range(2):  # opens the sub-groups' connections
                gemm_all_reduce(comm, x, weight, chunks=BLOCK_CHUNKS)
            return confirm_by_trial(
                comm,
                BLOCK_CHUNKS,
                lambda k: gemm_all_reduce(comm, x, weight, chunks=k),
                lambda: gemm_all_reduce_reference(comm, x, weight),
                runs=trial_runs,
                min_gain=config.min_gain,
            )
    if rows >= comm.world_size:
        # The row path's pieces are the ring's P steps; more groups only added per-group
        # overhead where measured (1024 x 8192 x 512 on 4 hosts: 0.91 of unfused with one ring,
        # 1.00 with two), so the choice is one ring or the unfused operator.
        limit = comm.world_size
    with torch.no_grad():
        out = torch.matmul(x, weight.t())
        # The first run of each transport opens gloo's connections between new pairs (measured:
        # 56-65 ms against 25-32 ms after); then the median of 3, each started together.
        samples = []
        for i in range(4):
            comm.barrier()
            compute_us, unfused_comm_us = measure(comm, x, weight)
            comm.barrier()
            sample = (compute_us, unfused_comm_us, measure_fused_comm_us(comm, out))
            if i:
                samples.append(sample)
        compute_us, unfused_comm_us, fused_comm_us = (
            sorted(v)[1] for v in zip(*samples, strict=True)
        )
        overhead_us = measure_overhead_us(comm)
        return choose_fused_chunks(
            comm,
            config,
            compute_us=compute_us,
            fused_comm_us=fused_comm_us,
            unfused_comm_us=unfused_comm_us,
            overhead_us=overhead_us,
            limit=limit,
            trial=(
                lambda k: gemm_all_reduce(comm, x, weight, chunks=k),
                lambda: gemm_all_reduce_reference(comm, x, weight),
            ),
            trial_runs=trial_runs,
        )

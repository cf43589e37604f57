"""GEMM + All-to-All and All-to-All + GEMM: the expert computation of a Mixture-of-Experts layer,
fused with the exchanges around it.

In expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021) rank ``r`` holds
``E_r`` of the ``E`` experts. A gate routes each token to ``k`` experts; the *dispatch*
All-to-All sends every routed row to the rank of its expert, the experts compute on the rows
they received, and the *combine* All-to-All sends each result back to the token's rank.
Both collectives depend on the computation next to them, so unfused they sit on the critical
path. Fused (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv 2305.06942, section 4.3):

* ``gemm_all_to_all`` (combine side, GEMM + All-to-All): post every receive; for destinations in
  ring order ``r+1, r+2, ..., r-1`` compute the expert GEMM of that destination's rows (cut into
  pieces when asked) and send each piece as soon as it is computed, while the next is computed;
  the local block is computed last (it never travels, so it hides the last transfers).
* ``all_to_all_gemm`` (dispatch side, All-to-All + GEMM): post every receive and every send (the
  rows exist already); compute the local block first, then each piece as soon as it arrives.
  All sources send at once and share the receiver's link, so their blocks arrive together;
  each block is therefore cut into ``chunks`` pieces, awaited piece-major (piece 0 of
  ``r-1, r-2, ...``, then piece 1, ...): ``chunks`` rounds of arrivals, each computed while the
  next travels. (Uncut, every block would arrive only at the end of the exchange.)

Each message lands in its place in the result (a view of the preallocated output), and each
GEMM writes straight into its rows of the output: no copy but the local block's rows.

Design notes: ``docs/fused.md``, "GEMM + All-to-All: layout and backward".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from commfuse.comm import Communicator, Handle
from commfuse.comm.clock import elapsed_us, now
from commfuse.fused import baselines
from commfuse.fused.chunking import split_ranges

#: Stats label of the fused operators' point-to-point traffic (exact bytes and messages).
LABEL = "gemm_all_to_all"


class Routing:
    """What every rank knows about one exchange: ``counts [P, E]`` and ``experts_per_rank``."""

    def __init__(self, comm: Communicator, counts: torch.Tensor, experts_per_rank: list[int]):
        world, rank = comm.world_size, comm.rank
        if len(experts_per_rank) != world or any(e < 1 for e in experts_per_rank):
            raise ValueError(
                f"experts_per_rank needs {world} entries >= 1 (one per rank), got {experts_per_rank}"
            )
        num_experts = sum(experts_per_rank)
        if counts.shape != (world, num_experts) or bool((counts < 0).any()):
            raise ValueError(
                f"counts must be a non-negative [world_size, num_experts] = [{world}, {num_experts}] "
                f"matrix, got {tuple(counts.shape)}"
            )
        self.rank, self.world = rank, world
        bounds = [sum(experts_per_rank[:j]) for j in range(world + 1)]
        mine = counts[:, bounds[rank] : bounds[rank + 1]]
        #: seg[i]: rows rank i sends to each of my local experts (the segments of block i).
        self.seg: list[list[int]] = mine.tolist()
        #: recv_rows[i]: rows of my expert side from source i; send_rows[j]: token-side rows to j.
        self.recv_rows = [sum(s) for s in self.seg]
        per_rank = [counts[:, bounds[j] : bounds[j + 1]].sum(1) for j in range(world)]
        self.send_rows: list[int] = [int(per_rank[j][rank]) for j in range(world)]
        self.recv_start = [sum(self.recv_rows[:i]) for i in range(world + 1)]
        self.send_start = [sum(self.send_rows[:j]) for j in range(world + 1)]
        self.local_experts = experts_per_rank[rank]

    def recv_block(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t[self.recv_start[src] : self.recv_start[src + 1]]

    def send_block(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        return t[self.send_start[dst] : self.send_start[dst + 1]]


def check_inputs(rt: Routing, rows: torch.Tensor, weight: torch.Tensor, side: str) -> None:
    """ValueError naming the problem (``side`` is "token" or "expert": where ``rows`` live)."""
    if weight.dim() != 3 or weight.shape[0] != rt.local_experts:
        raise ValueError(
            f"weight must be [local experts ({rt.local_experts}), out, in], got {tuple(weight.shape)}"
        )
    want = rt.send_start[-1] if side == "token" else rt.recv_start[-1]
    if rows.dim() != 2 or rows.shape[0] != want:
        raise ValueError(
            f"rank {rt.rank}: {side}-side rows must be [{want}, features] as counts say, "
            f"got {tuple(rows.shape)}"
        )
    k = weight.shape[2] if side == "expert" else rows.shape[1]
    if rows.shape[1] != k or rows.dtype != weight.dtype:
        raise ValueError(
            f"rows {tuple(rows.shape)} {rows.dtype} do not match weight {tuple(weight.shape)} "
            f"{weight.dtype}: features must equal the weight's in_features and dtypes must agree"
        )


def grouped_mm(
    rows: torch.Tensor,
    seg: list[int],
    lo: int,
    hi: int,
    weight: torch.Tensor,
    *,
    transpose: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[lo, hi)`` of one source block (segments ``seg`` per local expert) times their
    experts' weights: ``x @ W_e^T`` (``transpose``) or ``g @ W_e`` (the backward), written into
    ``out`` (``[hi - lo, width]``, e.g. a view of the caller's result: no copy) or a new tensor."""
    width = weight.shape[1] if transpose else weight.shape[2]
    if out is None:
        out = torch.empty((hi - lo, width), dtype=rows.dtype, device=rows.device)
    start = 0
    for e, n in enumerate(seg):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            w = weight[e].t() if transpose else weight[e]
            torch.matmul(rows[a - lo : b - lo], w, out=out[a - lo : b - lo])
        start += n
    return out


def add_weight_grad(
    grad_w: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor, seg: list[int]
) -> None:
    """``grad_w[e] += grad_e^T @ inp_e`` for one source block's segments (float32 accumulation)."""
    start = 0
    for e, n in enumerate(seg):
        if n:
            g, x = grad[start : start + n].float(), inp[start : start + n].float()
            grad_w[e].addmm_(g.t(), x)
        start += n


def _pieces(world: int, chunks: int) -> int:
    """Pieces per destination block where the blocks are computed one after another
    (``compute_then_exchange``): ``(P - 1) * pieces >= chunks`` stages in all."""
    return 1 if world == 1 else -(-chunks // (world - 1))


def _piece_major(rows: dict[int, int], pieces: int) -> list[tuple[int, int, int, int]]:
    """``(peer, tag, lo, hi)`` of each peer's block of ``rows[peer]`` rows cut into ``pieces``
    (``split_ranges``; the tag is the piece's index): piece 0 of every peer in ``rows``'s order,
    then piece 1, ..."""
    ranges = {peer: split_ranges(n, pieces) for peer, n in rows.items()}
    return [
        (peer, tag, *cut[tag])
        for tag in range(pieces)
        for peer, cut in ranges.items()
        if tag < len(cut)
    ]


def exchange_then_compute(
    comm: Communicator,
    rt: Routing,
    send: torch.Tensor,
    pieces: int,
    compute: Callable[[int, int, int, torch.Tensor], None],
) -> torch.Tensor:
    """Token side ``send`` to the expert side; ``compute(src, lo, hi, rows)`` runs on the local
    block first, then on each piece of each source block as soon as it has arrived. Returns the
    expert-side rows received (each message lands in its place: no copy but the local block).

    Every source sends at once, so the sources share this rank's link and their blocks arrive
    together: each block is cut into ``pieces`` and the pieces are awaited piece-major (piece 0
    of every source, then piece 1, ...), the order in which they arrive. A block in one piece
    would arrive only when the whole exchange has, leaving nothing to compute meanwhile."""
    rank, world = rt.rank, rt.world
    recv = torch.empty((rt.recv_start[-1], send.shape[1]), dtype=send.dtype, device=send.device)
    sources = [(rank - step) % world for step in range(1, world)]
    incoming: list[tuple[int, int, int, Handle, torch.Tensor]] = []
    for src, tag, lo, hi in _piece_major({s: rt.recv_rows[s] for s in sources}, pieces):
        block = rt.recv_block(recv, src)[lo:hi]
        incoming.append((src, lo, hi, comm.irecv(block, src, tag=tag, label=LABEL), block))
    destinations = [(rank + step) % world for step in range(1, world)]
    outgoing = [
        comm.isend(rt.send_block(send, dst)[lo:hi], dst, tag=tag, label=LABEL)
        for dst, tag, lo, hi in _piece_major({d: rt.send_rows[d] for d in destinations}, pieces)
    ]
    own = rt.recv_block(recv, rank)
    own.copy_(rt.send_block(send, rank))
    compute(rank, 0, own.shape[0], own)  # while the remote rows travel
    for src, lo, hi, handle, rows in incoming:
        handle.wait()
        compute(src, lo, hi, rows)
    for handle in outgoing:
        handle.wait()
    return recv


def compute_then_exchange(
    comm: Communicator,
    rt: Routing,
    width: int,
    dtype: torch.dtype,
    pieces: int,
    compute: Callable[[int, int, int, torch.Tensor | None], torch.Tensor],
    device: torch.device | str = "cpu",
    then: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Expert side to token side: ``compute(dst, lo, hi, out)`` makes rows ``[lo, hi)`` of the
    block bound for ``dst`` (into ``out`` when it is given, else a new tensor), each sent as soon
    as it is computed; the local block is computed last, straight into its place in the result,
    then ``then()`` (work that needs no communication) runs while the last pieces travel.
    Every destination's pieces are computed in turn (``r+1`` first), so at each moment every
    rank sends to one peer and receives from one: the blocks do not share a link."""
    rank, world = rt.rank, rt.world
    out = torch.empty((rt.send_start[-1], width), dtype=dtype, device=device)
    handles: list[Handle] = []
    for step in range(1, world):
        src = (rank - step) % world
        block = rt.send_block(out, src)
        for tag, (lo, hi) in enumerate(split_ranges(rt.send_rows[src], pieces)):
            handles.append(comm.irecv(block[lo:hi], src, tag=tag, label=LABEL))
    for step in range(1, world):
        dst = (rank + step) % world
        for tag, (lo, hi) in enumerate(split_ranges(rt.recv_rows[dst], pieces)):
            piece = compute(dst, lo, hi, None).contiguous()
            handles.append(comm.isend(piece, dst, tag=tag, label=LABEL))
    compute(rank, 0, rt.recv_rows[rank], rt.send_block(out, rank))
    if then is not None:
        then()
    for handle in handles:
        handle.wait()
    return out


def native_exchange(
    comm: Communicator,
    rt: Routing,
    rows: torch.Tensor,
    *,
    to_experts: bool,
    algo: str | None = None,
) -> torch.Tensor:
    """The unfused All-to-All (commfuse.collectives.all_to_all; "pairwise" counts exact bytes)."""
    from commfuse.collectives import all_to_all

    send_splits, recv_splits = (
        (rt.send_rows, rt.recv_rows) if to_experts else (rt.recv_rows, rt.send_rows)
    )
    width = rows.shape[1]
    out = torch.empty((sum(recv_splits), width), dtype=rows.dtype, device=rows.device)
    # Flat views with element splits: the front door infers a row's width from the input's first
    # row, which a rank that sends nothing does not have.
    all_to_all(
        comm,
        out.view(-1),
        rows.contiguous().view(-1),
        [n * width for n in recv_splits],
        [n * width for n in send_splits],
        algo=algo or baselines.ALL_TO_ALL,
    )
    return out


def expert_gemm(rt: Routing, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The computation alone: every expert-side row times its expert's weight."""
    out = torch.empty((rows.shape[0], weight.shape[1]), dtype=rows.dtype, device=rows.device)
    for src in range(rt.world):
        lo, hi = rt.recv_start[src], rt.recv_start[src + 1]
        grouped_mm(rows[lo:hi], rt.seg[src], 0, hi - lo, weight, transpose=True, out=out[lo:hi])
    return out


# -- forward ------------------------------------------------------------------------------------
def gemm_all_to_all_reference(
    comm: Communicator, rt: Routing, h: torch.Tensor, weight: torch.Tensor, algo: str | None = None
) -> torch.Tensor:
    """Unfused combine: every expert GEMM, then one All-to-All back to the token side."""
    check_inputs(rt, h, weight, "expert")
    return native_exchange(comm, rt, expert_gemm(rt, h, weight), to_experts=False, algo=algo)


def gemm_all_to_all(
    comm: Communicator, rt: Routing, h: torch.Tensor, weight: torch.Tensor, *, chunks: int
) -> torch.Tensor:
    """Fused combine (module docstring): expert side ``h [R_r, K]`` to token side ``[S_r, N]``.
    ``chunks=1`` is the unfused reference; each remote block is cut into
    ``ceil(chunks / (P - 1))`` pieces (the blocks are computed in turn). Every rank must pass
    the same ``chunks``."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    check_inputs(rt, h, weight, "expert")
    if chunks == 1 or rt.world == 1:
        return gemm_all_to_all_reference(comm, rt, h, weight)

    def compute(dst: int, lo: int, hi: int, out: torch.Tensor | None) -> torch.Tensor:
        rows = rt.recv_block(h, dst)[lo:hi]
        return grouped_mm(rows, rt.seg[dst], lo, hi, weight, transpose=True, out=out)

    pieces = _pieces(rt.world, chunks)
    return compute_then_exchange(comm, rt, weight.shape[1], h.dtype, pieces, compute, h.device)


def all_to_all_gemm_reference(
    comm: Communicator, rt: Routing, x: torch.Tensor, weight: torch.Tensor, algo: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused dispatch: one All-to-All to the expert side, then every expert GEMM.
    Returns (output ``[R_r, N]``, the received rows ``[R_r, K]``)."""
    check_inputs(rt, x, weight, "token")
    recv = native_exchange(comm, rt, x, to_experts=True, algo=algo)
    return expert_gemm(rt, recv, weight), recv


def all_to_all_gemm(
    comm: Communicator, rt: Routing, x: torch.Tensor, weight: torch.Tensor, *, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused dispatch (module docstring): token side ``x [S_r, K]`` to expert side, each piece
    multiplied as soon as it arrives; each remote block is cut into ``chunks`` pieces (the
    blocks arrive together). Returns (output ``[R_r, N]``, received rows ``[R_r, K]``)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    check_inputs(rt, x, weight, "token")
    if chunks == 1 or rt.world == 1:
        return all_to_all_gemm_reference(comm, rt, x, weight)
    out = torch.empty((rt.recv_start[-1], weight.shape[1]), dtype=x.dtype, device=x.device)

    def compute(src: int, lo: int, hi: int, rows: torch.Tensor) -> None:
        block = rt.recv_block(out, src)[lo:hi]
        grouped_mm(rows, rt.seg[src], lo, hi, weight, transpose=True, out=block)

    recv = exchange_then_compute(comm, rt, x.contiguous(), chunks, compute)
    return out, recv


# -- backward -----------------------------------------------------------------------------------
def gemm_all_to_all_backward(
    comm: Communicator,
    rt: Routing,
    grad_out: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_h, grad_weight) of ``gemm_all_to_all``: All-to-All + GEMM (module docstring)."""
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_h = torch.empty_like(h)

    def compute(src: int, lo: int, hi: int, g: torch.Tensor) -> None:
        rows, into = rt.recv_block(h, src)[lo:hi], rt.recv_block(grad_h, src)[lo:hi]
        grouped_mm(g, rt.seg[src], lo, hi, weight, transpose=False, out=into)
        _add_piece_grad(grad_w, g, rows, rt.seg[src], lo, hi)

    if chunks == 1 or rt.world == 1:
        g_all = native_exchange(comm, rt, grad_out, to_experts=True)
        for src in range(rt.world):
            compute(src, 0, rt.recv_rows[src], rt.recv_block(g_all, src))
    else:
        exchange_then_compute(comm, rt, grad_out.contiguous(), chunks, compute)
    return grad_h, grad_w.to(weight.dtype)


def all_to_all_gemm_backward(
    comm: Communicator,
    rt: Routing,
    grad_out: torch.Tensor,
    recv: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunks: int,
    grad_recv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of ``all_to_all_gemm``: GEMM + All-to-All (module docstring).
    ``grad_recv`` is a gradient flowing into the returned received rows, if any."""
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

    def compute(dst: int, lo: int, hi: int, out: torch.Tensor | None) -> torch.Tensor:
        g = rt.recv_block(grad_out, dst)[lo:hi]
        piece = grouped_mm(g, rt.seg[dst], lo, hi, weight, transpose=False, out=out)
        if grad_recv is not None:
            piece += rt.recv_block(grad_recv, dst)[lo:hi]
        return piece

    def weight_grad() -> None:
        for src in range(rt.world):
            g, rows = rt.recv_block(grad_out, src), rt.recv_block(recv, src)
            _add_piece_grad(grad_w, g, rows, rt.seg[src], 0, rt.recv_rows[src])

    if chunks == 1 or rt.world == 1:
        g_recv = torch.empty_like(recv)
        for s in range(rt.world):
            compute(s, 0, rt.recv_rows[s], rt.recv_block(g_recv, s))
        grad_x = native_exchange(comm, rt, g_recv, to_experts=False)
        weight_grad()
    else:
        # The weight gradient needs no communication: it runs while the last pieces travel.
        grad_x = compute_then_exchange(
            comm,
            rt,
            recv.shape[1],
            recv.dtype,
            _pieces(rt.world, chunks),
            compute,
            recv.device,
            then=weight_grad,
        )
    return grad_x, grad_w.to(weight.dtype)


def _add_piece_grad(
    grad_w: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, seg: list[int], lo: int, hi: int
) -> None:
    """``add_weight_grad`` for rows ``[lo, hi)`` of a block (segments cut to the piece)."""
    start, cut = 0, []
    for n in seg:
        cut.append(max(0, min(hi, start + n) - max(lo, start)))
        start += n
    add_weight_grad(grad_w, g, rows, cut)


# -- measurement ----------------------------------------------------------------------------------
def measure(
    comm: Communicator, rt: Routing, h: torch.Tensor, weight: torch.Tensor
) -> tuple[float, float, float]:
    """(compute_us, unfused_comm_us, fused_comm_us) of the combine side: the expert GEMMs alone,
    gloo's All-to-All of their output, and the fused path's point-to-point exchange of it."""
    start = now(comm.device)
    y = expert_gemm(rt, h, weight)
    compute_us = elapsed_us(start, comm.device)
    start = now(comm.device)
    native_exchange(comm, rt, y, to_experts=False)
    unfused_us = elapsed_us(start, comm.device)
    start = now(comm.device)

    def piece(dst: int, lo: int, hi: int, out: torch.Tensor | None) -> torch.Tensor:
        block = rt.recv_block(y, dst)[lo:hi]
        return block if out is None else out.copy_(block)

    compute_then_exchange(comm, rt, y.shape[1], y.dtype, 1, piece, y.device)
    return compute_us, unfused_us, elapsed_us(start, comm.device)

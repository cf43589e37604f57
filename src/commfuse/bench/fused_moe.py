"""The ``gemm_all_to_all`` case of ``commfuse bench fused``: the MoE combine side (expert GEMMs +
the All-to-All back to the tokens' ranks), fused against unfused.

Shape ``(rows, in_features, out_features, experts_per_rank)``: every rank routes ``rows`` rows
to the ``P * experts_per_rank`` experts uniformly at random (the same draw on every rank, so the
counts are known everywhere without communicating), so the expert side of each rank receives
about ``rows`` rows and sends ``(P - 1) / P`` of its output away.

``moe_step`` times a whole training step of the MoE workload (``workloads/moe.py``), shape
``(tokens_per_rank, d_model, d_hidden, experts_per_rank)``: unfused (both All-to-Alls after their
GEMMs, gloo's) against fused (chunks chosen by the layer), and beside it fused with fixed
chunk counts (``_FIXED_CHUNKS``, rows ``moe_step[k=N]``). ``compute`` is the same step on a
one-rank group holding ``experts_per_rank`` experts (the same expert FLOPs: every routed row stays
local), ``comm`` the step's four All-to-Alls (dispatch and combine, forward and backward) and
its two allreduces of replicated gradients alone. Its dispatch and combine exchanges and its two
expert GEMMs are also timed alone (``stage:NAME``), for the dependency-aware bound
``moe_step_bound_us``: perfect overlap assumes any communication can hide behind any
computation, where the step lets each exchange hide only behind the GEMMs next to it, and
only as far as the CPU of both fits on the machine's cores (each stage's CPU floor).
``fused/dep`` divides by the larger of that and the CPU floor (``bench/cpu_floor.py``), since
with ranks sharing cores the exchanges' CPU work competes with the GEMMs. ``fused/graph``
divides by the bound of the step's graph on the shared cores (``moe_step_graph``, from the
dispatch's first piece round and the all-reduce after the backward, each timed alone, with the
work that may run beside them: the first GEMM's local blocks, ``update``). The learning rate is
1e-30, so every timed step sees (numerically) the same parameters; the records' ``wrong``
compares losses rounded to 4 decimals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from commfuse.bench.fused import FusedForms
from commfuse.collectives import all_reduce
from commfuse.comm import Communicator
from commfuse.fused import gemm_all_to_all as ga
from commfuse.fused.chunking import ChunkConfig
from commfuse.fused.moe import choose_moe_chunks
from commfuse.sim.bound import GlobalWait, StepGraph
from commfuse.workloads.moe import LATE_ALL_REDUCE, MoEConfig, MoEModel, MoEWorkload


def gemm_all_to_all_case(comm: Communicator, shape: tuple[int, ...]) -> FusedForms:
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(
            f"gemm_all_to_all shape is (rows, in_features, out_features, experts_per_rank), got {shape}"
        )
    rows, k_in, n_out, per_rank = shape
    world = comm.world_size
    experts = [per_rank] * world
    gen = torch.Generator().manual_seed(1234)
    counts = torch.stack(
        [
            torch.bincount(
                # routing counts are host metadata (split sizes), drawn on the CPU
                torch.randint(0, sum(experts), (rows,), generator=gen, device="cpu"),
                minlength=sum(experts),
            )
            for _ in range(world)
        ]
    )
    rt = ga.Routing(comm, counts, experts)
    own = torch.Generator().manual_seed(comm.rank)
    dev = comm.device
    h = torch.randint(-2, 3, (rt.recv_start[-1], k_in), generator=own, device="cpu").float().to(dev)
    w = torch.randint(-2, 3, (per_rank, n_out, k_in), generator=own, device="cpu").float().to(dev)
    y = ga.expert_gemm(rt, h, w)
    max_chunks = 4 * max(world - 1, 1)
    return FusedForms(
        compute=lambda: ga.expert_gemm(rt, h, w),
        comm=lambda: ga.native_exchange(comm, rt, y, to_experts=False),
        unfused=lambda: ga.gemm_all_to_all_reference(comm, rt, h, w),
        fused=lambda k: ga.gemm_all_to_all(comm, rt, h, w, chunks=k),
        max_chunks=max_chunks,
        choose=lambda: choose_moe_chunks(comm, rt, h, w, ChunkConfig(max_chunks=max_chunks)),
    )


#: The fixed chunk counts ``moe_step`` times beside the layer's own choice: few pieces, the
#: fewest whose dispatch round the local blocks can hide (``moe_step_graph``'s bound picks it on
#: four ranks and two cores), and many.
_FIXED_CHUNKS = (2, 3, 5)


def moe_step_case(comm: Communicator, shape: tuple[int, ...]) -> FusedForms:
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(
            f"moe_step shape is (tokens_per_rank, d_model, d_hidden, experts_per_rank), got {shape}"
        )
    tokens, d_model, d_hidden, per_rank = shape
    world = comm.world_size
    options = MoEConfig(
        d_model=d_model,
        d_hidden=d_hidden,
        num_experts=per_rank * world,
        tokens_per_rank=tokens,
        lr=1e-30,  # SGD needs lr > 0; this leaves every parameter as it was
    )
    workload = MoEWorkload(options)
    batch = workload.batch(0, comm.rank, seed=0, device=comm.device)
    models: dict[int | None, tuple[MoEModel, torch.optim.Optimizer]] = {}

    def model(chunks: int | None) -> tuple[MoEModel, torch.optim.Optimizer]:
        if chunks not in models:
            m = workload.build_model(comm, 0, fused=chunks != 1, num_chunks=chunks)
            models[chunks] = (m, workload.make_optimizer(m))
        return models[chunks]

    def step(chunks: int | None) -> torch.Tensor:
        m, opt = model(chunks)
        return torch.tensor(
            [round(workload.train_step(comm, m, opt, batch), 4)], device=comm.device
        )

    def choose() -> int:
        step(None)  # the layer measures and agrees its chunks on its first forward
        return model(None)[0].moe._chunks[torch.float32]

    local = comm.split([[r] for r in range(world)], name="moe_local")
    # top_k experts at least, so every token still makes top_k expert passes (the same FLOPs).
    local_experts = max(per_rank, options.top_k)
    local_workload = MoEWorkload(dataclasses.replace(options, num_experts=local_experts))
    local_model = local_workload.build_model(local, 0, fused=False)
    local_opt = local_workload.make_optimizer(local_model)
    # The step's communication alone, on buffers of its sizes (uniform routing, top-2).
    gen = torch.Generator().manual_seed(1234)
    counts = torch.stack(
        [
            torch.bincount(
                torch.randint(0, options.num_experts, (2 * tokens,), generator=gen, device="cpu"),
                minlength=options.num_experts,
            )
            for _ in range(world)
        ]
    )
    rt = ga.Routing(comm, counts, [per_rank] * world)
    token_side = torch.zeros(rt.send_start[-1], d_model, device=comm.device)
    expert_side = torch.zeros(rt.recv_start[-1], d_model, device=comm.device)
    reference = model(1)[0]
    head = sum(p.numel() for p in reference.head.parameters())
    rest = sum(p.numel() for p in reference.replicated()) - head
    # The step's two all-reduces of replicated gradients: the head's, then the rest.
    replicated = [torch.zeros(n, device=comm.device) for n in (head, rest)]

    def communicate() -> Any:
        for _ in range(2):  # forward and backward
            ga.native_exchange(comm, rt, token_side, to_experts=True)
            ga.native_exchange(comm, rt, expert_side, to_experts=False)
        comm.all_reduce(replicated[0])
        all_reduce(comm, replicated[1], algo=LATE_ALL_REDUCE)

    # The expert GEMMs alone, forward, on the expert side's rows of this routing.
    own = torch.Generator().manual_seed(comm.rank)
    rows_in = torch.randn(rt.recv_start[-1], d_model, generator=own, device="cpu").to(comm.device)
    hidden = torch.randn(rt.recv_start[-1], d_hidden, generator=own, device="cpu").to(comm.device)
    w1 = torch.randn(per_rank, d_hidden, d_model, generator=own, device="cpu").to(comm.device)
    w2 = torch.randn(per_rank, d_model, d_hidden, generator=own, device="cpu").to(comm.device)
    return FusedForms(
        compute=lambda: local_workload.train_step(local, local_model, local_opt, batch),
        comm=communicate,
        unfused=lambda: step(1),
        fused=step,
        max_chunks=16,
        choose=choose,
        stages={
            "dispatch": lambda: ga.native_exchange(comm, rt, token_side, to_experts=True),
            "combine": lambda: ga.native_exchange(comm, rt, expert_side, to_experts=False),
            "gemm1": lambda: ga.expert_gemm(rt, rows_in, w1),
            "gemm2": lambda: ga.expert_gemm(rt, hidden, w2),
            # The step's last wait and the work the graph lets run beside it.
            "allreduce": lambda: all_reduce(comm, replicated[1], algo=LATE_ALL_REDUCE),
            "allreduce_ring": lambda: comm.all_reduce(replicated[1]),  # gloo's
            "update": _update(workload, comm),
        },
        bound=moe_step_bound_us,
        graph=functools.partial(
            moe_step_graph, ranks=world, local_share=_local_share(counts, per_rank)
        ),
        # Fixed counts beside the layer's choice, in the same rounds (wall and CPU): few pieces
        # against many, each dispatch piece one more message per source.
        alternatives={f"k={k}": functools.partial(step, k) for k in _FIXED_CHUNKS},
    )


def moe_step_bound_us(medians: dict[str, float], floors: dict[str, float] | None = None) -> float:
    """The MoE step's dependency-aware bound: the step's computation and communication, less
    what its dependencies let overlap. An exchange can hide only behind the expert GEMMs next
    to it, and only with infinitely fine pieces (so this is a bound, not a prediction): the
    dispatch behind the first GEMM, the combine behind the second, and in the backward the
    reverse combine (the dispatch's size) behind the second GEMM's gradients and the reverse
    dispatch (the combine's size) behind the first's, each gradient pair taken as twice its
    forward GEMM. The gate, the routing, the activation, the loss, the optimizer and the
    all-reduces of the replicated gradients overlap nothing (the head's travels during the
    backward, but it is small next to the exchanges). Unlike ``overlap`` it counts no
    contention between the two (the parts are timed alone). ``medians`` holds ``compute``,
    ``comm``, ``dispatch``, ``combine``, ``gemm1`` and ``gemm2``, in any one unit.

    ``floors`` (the same stages' CPU floors, ``bench/cpu_floor.py``, in the same unit) makes it
    the critical path of a machine whose cores the ranks share: an exchange and the GEMMs it
    hides behind then take at least the time the cores need for the CPU of both, so each
    overlapped pair lasts ``max(exchange, gemms, floor(exchange) + floor(gemms))`` and hides
    what it saves on the two in turn. Without ``floors`` the exchanges' CPU is taken as free."""
    d, c = medians["dispatch"], medians["combine"]
    g1, g2 = medians["gemm1"], medians["gemm2"]
    f = floors or {}
    fd, fc = f.get("dispatch", 0.0), f.get("combine", 0.0)
    f1, f2 = f.get("gemm1", 0.0), f.get("gemm2", 0.0)
    pairs = ((d, fd, g1, f1), (c, fc, g2, f2), (d, fd, 2 * g2, 2 * f2), (c, fc, 2 * g1, 2 * f1))
    hidden = sum(x + g - max(x, g, fx + fg) for x, fx, g, fg in pairs)
    return medians["compute"] + medians["comm"] - hidden


def _local_share(counts: torch.Tensor, per_rank: int) -> float:
    """The largest share, over ranks, of an expert side's rows that stay on their rank (the
    local block): the most of a GEMM any rank can run before a remote row arrives."""
    world = counts.shape[0]
    shares = []
    for r in range(world):
        mine = counts[:, r * per_rank : (r + 1) * per_rank].sum(1)
        shares.append(float(mine[r]) / max(float(mine.sum()), 1.0))
    return max(shares)


def _update(workload: MoEWorkload, comm: Communicator) -> Any:
    """The step's work after its last all-reduce that does not wait for it, on a model of its
    own: every gradient scaled once (the expert gradients by ``1 / P`` and the head's average,
    in the step) and one optimizer step."""
    m = workload.build_model(comm, 0, fused=False)
    opt = workload.make_optimizer(m)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)

    def update() -> None:
        for p in m.parameters():
            assert p.grad is not None
            p.grad.mul_(1.0)
        opt.step()

    return update


#: The chunk counts the MoE layer may choose (``ChunkConfig.max_chunks``'s default).
_MAX_LAYER_CHUNKS = ChunkConfig().max_chunks


def moe_step_graph(
    medians: dict[str, float],
    cpu: dict[str, float],
    *,
    floor_us: float,
    cores: float,
    ranks: int,
    local_share: float,
) -> StepGraph:
    """The MoE step's graph for ``sim.bound.step_bound``, from its parts timed alone
    (``medians``: wall us of ``compute`` and each stage; ``cpu``: their CPU us, all ranks).

    Its global waits (every rank's next work needs every rank's data):

    * the dispatch's first piece round: the expert GEMMs await the dispatch piece-major, so no
      remote row is multiplied before the first piece of every source is in (``k`` pieces: the
      dispatch alone over ``k``); the local blocks of the first GEMM (``local_share`` of its
      rows on any rank at most) may run meanwhile;
    * the all-reduce of the gate's and the norm's gradients after the backward (the faster of
      the step's ``allreduce`` and gloo's ring, ``allreduce_ring``): the update of every
      parameter (scaling and the optimizer, ``update``) may run meanwhile.

    Left out, as other work may fill them: the counts exchange (the routed rows are gathered
    meanwhile), the reverse combine's first round in the backward (the local blocks of the
    second GEMM's gradients, twice its forward, fill it) and the last pieces of each
    compute-then-exchange side (only their destination waits for them). One rank's computation
    is the computation alone (``compute``) over the ranks."""

    def wait(name: str, timed: str, **kw: Any) -> GlobalWait:
        return GlobalWait.alone(name, medians[timed], cpu[timed], **kw)

    # The faster of the all-reduces timed: a bound may not charge a slower one than exists.
    fastest = min(("allreduce", "allreduce_ring"), key=lambda n: medians.get(n, math.inf))

    return StepGraph(
        ranks=ranks,
        cores=cores,
        floor_us=floor_us,
        rank_compute_us=cpu["compute"] / ranks,
        waits=(
            wait("dispatch", "dispatch", chunked=True, fill_us=local_share * cpu["gemm1"]),
            wait("allreduce", fastest, fill_us=cpu["update"]),
        ),
        chunk_choices=tuple(range(1, _MAX_LAYER_CHUNKS + 1)),
    )

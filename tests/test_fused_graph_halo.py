"""Graph aggregation fused with its halo exchange (``commfuse.fused.graph_halo``) and the GCN
workload: on 1-4 gloo ranks, ``Exact`` output and gradients equal the single-process full-graph
``A @ H`` and ``A^T @ G`` (fp64, 1e-12), each direction sends exactly boundary rows x d x 8
bytes; ``Sample(p=1.0)`` equals ``Exact`` bit for bit and ``Sample(p=0.5)`` sends only its
sampled rows; ``Stale(steps=k)`` equals the reference that aggregates the halo of step
``max(0, t - k)`` (and adds that step's halo gradients), k = 1, 2; a 2-layer GCN's and GraphSAGE's logits and SGD step equal
plain torch's on the whole graph, and the GCN's loss falls in every mode. The partitioner covers every node once, in
balanced parts, with a cut below a random partition's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from commfuse.collectives.registry import label
from commfuse.comm import Communicator
from commfuse.fused import baselines
from commfuse.fused import graph_halo as gh
from commfuse.testing import RankPool
from commfuse.workloads.gnn import GCN, GraphSAGE
from commfuse.workloads.graph import (
    GraphConfig,
    cut_edges,
    halo_plan,
    make_graph,
    normalized_adjacency,
    partition,
)

PoolFn = Callable[[int], RankPool]
SMALL = GraphConfig(num_nodes=150, num_communities=4, avg_degree=6.0, num_features=6, seed=3)
TOL = 1e-12


def setup(world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, gh.HaloPlan, torch.Tensor]:
    graph = make_graph(SMALL)
    adj = normalized_adjacency(graph, torch.float64)
    owner = partition(graph, world)
    plan, nodes = halo_plan(adj, owner, rank, world)
    return adj.to_dense(), owner, plan, nodes


def rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def run_op(
    comm: Communicator,
    plan: gh.HaloPlan,
    h: torch.Tensor,
    grad: torch.Tensor,
    mode: gh.HaloMode,
    state: gh.HaloState,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Output, input gradient, and the bytes sent forward and backward."""
    x = h.clone().requires_grad_(True)
    comm.stats.reset()
    out = gh.halo_aggregate(comm, plan, x, mode=mode, state=state)
    sent_fwd = comm.stats[gh.LABEL].bytes_sent
    comm.stats.reset()
    torch.autograd.backward(out, grad)
    assert x.grad is not None
    return out.detach(), x.grad, sent_fwd, comm.stats[gh.LABEL].bytes_sent


def exact_and_sample() -> list[str]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    dense, _, plan, nodes = setup(world, rank)
    failures: list[str] = []
    dim = 5
    h_full, g_full = rand((SMALL.num_nodes, dim), 1), rand((SMALL.num_nodes, dim), 2)
    h, g = h_full[nodes], g_full[nodes]
    out, grad, fwd, bwd = run_op(comm, plan, h, g, gh.Exact(), gh.HaloState())
    where = f"rank {rank}/{world}"
    if not torch.allclose(out, (dense @ h_full)[nodes], atol=TOL, rtol=0):
        failures.append(f"{where}: exact output differs from A @ H")
    if not torch.allclose(grad, (dense.t() @ g_full)[nodes], atol=TOL, rtol=0):
        failures.append(f"{where}: exact gradient differs from A^T @ G")
    want_fwd, want_bwd = plan.boundary_rows() * dim * 8, sum(plan.recv_counts) * dim * 8
    if (fwd, bwd) != (want_fwd, want_bwd):
        failures.append(f"{where}: sent {fwd}/{bwd} bytes, want {want_fwd}/{want_bwd}")
    if world > 1 and want_fwd == 0:
        failures.append(f"{where}: no boundary rows: the test graph is too easy")
    x = h.clone().requires_grad_(True)
    comm.stats.reset()
    ref = gh.halo_aggregate_reference(comm, plan, x)
    torch.autograd.backward(ref, g)
    ref_bytes = comm.stats[label("all_to_all", baselines.ALL_TO_ALL)].bytes_sent
    if world > 1 and ref_bytes != want_fwd + want_bwd:
        failures.append(
            f"{where}: the unfused reference sent {ref_bytes}, want {want_fwd + want_bwd}"
        )
    if not (
        torch.allclose(ref.detach(), out, atol=TOL, rtol=0)
        and x.grad is not None
        and torch.allclose(x.grad, grad, atol=TOL, rtol=0)
    ):
        failures.append(f"{where}: the unfused reference differs from the fused operator")
    s_out, s_grad, s_fwd, s_bwd = run_op(comm, plan, h, g, gh.Sample(p=1.0), gh.HaloState())
    if not (torch.equal(s_out, out) and torch.equal(s_grad, grad) and (s_fwd, s_bwd) == (fwd, bwd)):
        failures.append(f"{where}: Sample(p=1.0) differs from Exact")
    state = gh.HaloState()
    half = gh.Sample(p=0.5, seed=4)
    masks = gh.exchange_masks(comm, plan, half, 0)
    _, _, h_fwd, h_bwd = run_op(comm, plan, h, g, half, state)
    rows_out = sum(int(masks[2 * j].numel()) for j in range(world))
    rows_in = sum(int(masks[2 * j + 1].numel()) for j in range(world))
    if (h_fwd, h_bwd) != (rows_out * dim * 8, rows_in * dim * 8):
        failures.append(
            f"{where}: Sample(0.5) sent {h_fwd}/{h_bwd}, want {rows_out}/{rows_in} rows"
        )
    if world > 1 and rows_out >= plan.boundary_rows():
        failures.append(f"{where}: Sample(0.5) sent every boundary row")
    return failures


def stale() -> list[str]:
    """Four steps of ``Stale(steps=k)`` against ``B_same H_t + B_cross H_{max(0, t-k)}`` (and
    its transpose for the gradients), k = 1 and 2."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    dense, owner, plan, nodes = setup(world, rank)
    same = (owner[:, None] == owner[None, :]).to(torch.float64)
    b_same, b_cross = dense * same, dense * (1 - same)
    failures: list[str] = []
    dim = 3
    hs = [rand((SMALL.num_nodes, dim), 10 + t) for t in range(4)]
    gs = [rand((SMALL.num_nodes, dim), 20 + t) for t in range(4)]
    for k in (1, 2):
        state = gh.HaloState()
        for t in range(4):
            out, grad, _, _ = run_op(
                comm, plan, hs[t][nodes], gs[t][nodes], gh.Stale(steps=k), state
            )
            old = max(0, t - k)
            want = (b_same @ hs[t] + b_cross @ hs[old])[nodes]
            want_grad = (b_same.t() @ gs[t] + b_cross.t() @ gs[old])[nodes]
            where = f"rank {rank}/{world} steps={k} step {t}"
            if not torch.allclose(out, want, atol=TOL, rtol=0):
                failures.append(f"{where}: stale output differs")
            if not torch.allclose(grad, want_grad, atol=TOL, rtol=0):
                failures.append(f"{where}: stale gradient differs")
    return failures


def gcn() -> list[str]:
    """A 2-layer GCN's logits and one SGD step equal plain torch's on the whole graph; then a
    few steps in each mode lower the loss."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    dense, _, plan, nodes = setup(world, rank)
    graph = make_graph(SMALL)
    x_full, labels_full = graph.features.double(), graph.labels
    train_full = torch.arange(SMALL.num_nodes) % 2 == 0
    num_train = int(train_full.sum())
    dims = [SMALL.num_features, 8, SMALL.num_communities]
    model = GCN(comm, plan, dims, dtype=torch.float64, seed=5)
    ref = [w.detach().clone().requires_grad_(True) for w in model.weights]
    logits_ref = dense @ (torch.relu(dense @ (x_full @ ref[0])) @ ref[1])
    x, labels, train = x_full[nodes], labels_full[nodes], train_full[nodes]
    failures: list[str] = []
    if not torch.allclose(model(x).detach(), logits_ref[nodes].detach(), atol=TOL, rtol=0):
        failures.append(f"rank {rank}/{world}: GCN logits differ from the full graph's")
    loss_ref = torch.nn.functional.cross_entropy(logits_ref[train_full], labels_full[train_full])
    torch.autograd.backward(loss_ref)
    loss = model.train_step(x, labels, train, num_train, lr=0.5)
    if abs(loss - float(loss_ref)) > TOL:
        failures.append(f"rank {rank}/{world}: loss {loss} != {float(loss_ref)}")
    for i, (w, r) in enumerate(zip(model.weights, ref, strict=True)):
        assert r.grad is not None
        if not torch.allclose(w.detach(), r.detach() - 0.5 * r.grad, atol=TOL, rtol=0):
            failures.append(f"rank {rank}/{world}: weight {i} after a step differs")
    for mode in (gh.Exact(), gh.Stale(), gh.Sample(p=0.5)):
        model = GCN(comm, plan, dims, mode=mode, dtype=torch.float64, seed=5)
        losses = [model.train_step(x, labels, train, num_train, lr=0.5) for _ in range(15)]
        if not losses[-1] < 0.8 * losses[0]:
            failures.append(f"rank {rank}/{world} {mode}: loss {losses[0]} -> {losses[-1]}")
    return failures


def sage() -> list[str]:
    """A 2-layer GraphSAGE (mean aggregator) and one SGD step equal plain torch's on the whole
    graph."""
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    graph = make_graph(SMALL)
    adj = normalized_adjacency(graph, torch.float64, kind="mean")
    plan, nodes = halo_plan(adj, partition(graph, world), rank, world)
    mean = adj.to_dense()
    x_full, labels_full = graph.features.double(), graph.labels
    train_full = torch.arange(SMALL.num_nodes) % 3 != 0
    dims = [SMALL.num_features, 7, SMALL.num_communities]
    model = GraphSAGE(comm, plan, dims, dtype=torch.float64, seed=6)
    ws = [w.detach().clone().requires_grad_(True) for w in model.self_weights]
    wn = [w.detach().clone().requires_grad_(True) for w in model.neighbour_weights]
    hidden = torch.relu(x_full @ ws[0] + mean @ (x_full @ wn[0]))
    logits_ref = hidden @ ws[1] + mean @ (hidden @ wn[1])
    loss_ref = torch.nn.functional.cross_entropy(logits_ref[train_full], labels_full[train_full])
    torch.autograd.backward(loss_ref)
    where = f"rank {rank}/{world}"
    failures: list[str] = []
    x = x_full[nodes]
    if not torch.allclose(model(x).detach(), logits_ref[nodes].detach(), atol=TOL, rtol=0):
        failures.append(f"{where}: GraphSAGE logits differ from the full graph's")
    loss = model.train_step(x, labels_full[nodes], train_full[nodes], int(train_full.sum()), lr=0.5)
    if abs(loss - float(loss_ref)) > TOL:
        failures.append(f"{where}: loss {loss} != {float(loss_ref)}")
    trained = [*model.self_weights, *model.neighbour_weights]
    for i, (w, r) in enumerate(zip(trained, [*ws, *wn], strict=True)):
        assert r.grad is not None
        if not torch.allclose(w.detach(), r.detach() - 0.5 * r.grad, atol=TOL, rtol=0):
            failures.append(f"{where}: weight {i} after a step differs")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_and_sample(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(exact_and_sample, timeout_s=120) for f in r]
    assert not failures, failures


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stale_uses_the_previous_halo(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(stale, timeout_s=120) for f in r]
    assert not failures, failures


@pytest.mark.parametrize("world", [1, 3])
def test_gcn_equals_full_graph(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(gcn, timeout_s=120) for f in r]
    assert not failures, failures


@pytest.mark.parametrize("world", [1, 2])
def test_graphsage_equals_full_graph(pool: PoolFn, world: int) -> None:
    failures = [f for r in pool(world).run(sage, timeout_s=120) for f in r]
    assert not failures, failures


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_partition_covers_and_cuts_less_than_random(parts: int) -> None:
    graph = make_graph(GraphConfig(num_nodes=600, seed=1))
    grown = partition(graph, parts, num_passes=0)
    owner = partition(graph, parts)
    for got in (grown, owner):
        assert got.numel() == graph.num_nodes and int(got.min()) >= 0 and int(got.max()) < parts
    counts = torch.bincount(grown, minlength=parts)
    assert int(counts.max() - counts.min()) <= 1
    share = graph.num_nodes / parts
    counts = torch.bincount(owner, minlength=parts)
    assert share * 0.97 - 1 <= int(counts.min()) and int(counts.max()) <= share * 1.03 + 1
    assert cut_edges(graph, owner) <= cut_edges(graph, grown)
    perm = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(99))
    random_owner = torch.empty_like(owner)
    random_owner[perm] = torch.arange(graph.num_nodes) % parts
    assert cut_edges(graph, grown) < 0.85 * cut_edges(graph, random_owner)
    assert cut_edges(graph, owner) < 0.7 * cut_edges(graph, random_owner)


def test_plans_agree_and_bad_input_raises() -> None:
    graph = make_graph(SMALL)
    adj = normalized_adjacency(graph, torch.float64)
    owner = partition(graph, 3)
    plans = [halo_plan(adj, owner, r, 3)[0] for r in range(3)]
    for r in range(3):
        for j in range(3):
            assert plans[r].send_rows[j].numel() == plans[j].recv_counts[r]
    with pytest.raises(ValueError, match=r"Sample\.p"):
        gh.Sample(p=0.0)
    with pytest.raises(ValueError, match=r"Stale\.steps"):
        gh.Stale(steps=0)
    with pytest.raises(ValueError, match="owner"):
        halo_plan(adj, owner, 0, 2)

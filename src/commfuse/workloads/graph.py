"""A synthetic graph for node classification, its offline partition, and each rank's halo plan.

Graph (seeded, nothing downloaded): a degree-corrected planted partition (Karrer and Newman,
"Stochastic blockmodels and community structure in networks", 2011). Each node gets a community
``c_i`` and a power-law weight ``theta_i`` (Pareto, exponent ``alpha``). An edge picks one end
with probability proportional to ``theta``, the other in the same community with probability
``mixing_in`` (else anywhere), again by ``theta``: hubs, and more edges inside communities than
across. Features are the community's random mean plus Gaussian noise; labels are the
communities. ``normalized_adjacency`` is GCN's ``D^-1/2 (A + I) D^-1/2`` (Kipf and Welling,
ICLR 2017) or GraphSAGE's neighbour mean ``D^-1 A``.

Partition (``partition``): greedy BFS growth, as METIS's initial partitioning grows regions
(Karypis and Kumar, 1998): part ``k`` grows breadth-first from an unassigned node of highest
degree until it holds its share of the nodes, so neighbours land together; then a few passes of
balanced label propagation (Ugander and Backstrom, WSDM 2013) move each node to the part that
holds most of its neighbours while every part stays within ``imbalance`` of its share, which
cuts fewer edges still. ``halo_plan`` turns the partition into one rank's ``HaloPlan`` for
``commfuse.fused.graph_halo``: its nodes (by global id), the rows it sends each peer and the
halo rows it receives, both sides ordered by global id so that they agree without talking.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from typing import Literal

import torch

from commfuse.fused.graph_halo import HaloPlan


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphConfig:
    """The synthetic graph's shape."""

    num_nodes: int = 2000
    """Nodes in the graph."""
    num_communities: int = 8
    """Planted communities (the classes)."""
    avg_degree: float = 10.0
    """Mean degree before removing duplicate edges and self-loops."""
    mixing_in: float = 0.8
    """Fraction of edges drawn inside a community."""
    alpha: float = 2.5
    """Power-law exponent of the degree weights (Pareto shape ``alpha - 1``)."""
    num_features: int = 16
    """Input features per node."""
    signal: float = 1.0
    """Scale of the community means in the features (noise has unit variance)."""
    seed: int = 0
    """Seeds everything: the same graph on every rank."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_communities < 1 or self.num_features < 1:
            raise ValueError("num_nodes, num_communities and num_features must be >= 1")
        if not 0.0 <= self.mixing_in <= 1.0 or self.alpha <= 1.0 or self.avg_degree <= 0:
            raise ValueError("need 0 <= mixing_in <= 1, alpha > 1 and avg_degree > 0")


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """An undirected graph with node features and labels."""

    edges: torch.Tensor
    """``[2, E]`` int64, both directions of every edge, no self-loop, no duplicate."""
    features: torch.Tensor
    """``[N, F]`` float32."""
    labels: torch.Tensor
    """``[N]`` int64: the planted community."""

    @property
    def num_nodes(self) -> int:
        return int(self.labels.numel())


def make_graph(config: GraphConfig) -> Graph:
    """The planted-partition graph of ``config`` (module docstring)."""
    gen = torch.Generator().manual_seed(config.seed)
    n, k = config.num_nodes, config.num_communities
    labels = torch.randint(0, k, (n,), generator=gen, device="cpu")
    theta = (1.0 - torch.rand(n, generator=gen, dtype=torch.float64, device="cpu")) ** (
        -1.0 / (config.alpha - 1)
    )
    m = max(1, int(n * config.avg_degree / 2))
    src = torch.multinomial(theta, m, replacement=True, generator=gen)
    dst = torch.multinomial(theta, m, replacement=True, generator=gen)
    inside = torch.rand(m, generator=gen, device="cpu") < config.mixing_in
    for c in range(k):
        members = torch.nonzero(labels == c).flatten()
        pick = torch.nonzero(inside & (labels[src] == c)).flatten()
        if pick.numel():
            draw = torch.multinomial(theta[members], pick.numel(), replacement=True, generator=gen)
            dst[pick] = members[draw]
    keep = src != dst
    both = torch.cat([torch.stack([src[keep], dst[keep]]), torch.stack([dst[keep], src[keep]])], 1)
    edges = torch.unique(both, dim=1)
    means = torch.randn(k, config.num_features, generator=gen, device="cpu") * config.signal
    features = means[labels] + torch.randn(n, config.num_features, generator=gen, device="cpu")
    return Graph(edges=edges, features=features, labels=labels)


def normalized_adjacency(
    graph: Graph, dtype: torch.dtype = torch.float32, *, kind: Literal["gcn", "mean"] = "gcn"
) -> torch.Tensor:
    """Sparse COO ``[N, N]``, coalesced: GCN's ``D^-1/2 (A + I) D^-1/2`` (``"gcn"``), or
    GraphSAGE's neighbour mean ``D^-1 A`` (``"mean"``; a node without neighbours gets none)."""
    n = graph.num_nodes
    if kind == "mean":
        deg = torch.bincount(graph.edges[0], minlength=n).to(dtype)
        values = 1.0 / deg[graph.edges[0]]
        return torch.sparse_coo_tensor(graph.edges, values, (n, n)).coalesce()
    if kind != "gcn":
        raise ValueError(f'kind must be "gcn" or "mean", got {kind!r}')
    loops = torch.arange(n, device=graph.edges.device).repeat(2, 1)
    idx = torch.cat([graph.edges, loops], dim=1)
    deg = torch.bincount(idx[0], minlength=n).to(dtype)
    values = deg[idx[0]].rsqrt() * deg[idx[1]].rsqrt()
    return torch.sparse_coo_tensor(idx, values, (n, n)).coalesce()


def partition(
    graph: Graph, num_parts: int, *, imbalance: float = 0.03, num_passes: int = 4
) -> torch.Tensor:
    """The part (rank) of each node, ``[N]`` int64: greedy BFS growth, then ``num_passes`` of
    balanced label propagation (module docstring; ``num_passes=0``: BFS only, parts differing by
    at most one node). Every part holds between ``(1 - imbalance)`` and ``(1 + imbalance)``
    times ``N / num_parts`` nodes, rounded outwards.

    Raises:
        ValueError: ``num_parts < 1``, a negative ``imbalance`` or ``num_passes``.
    """
    if num_parts < 1 or imbalance < 0 or num_passes < 0:
        raise ValueError(
            f"need num_parts >= 1, imbalance >= 0, num_passes >= 0; got {num_parts}, "
            f"{imbalance}, {num_passes}"
        )
    n = graph.num_nodes
    neighbours: list[list[int]] = [[] for _ in range(n)]
    for u, v in graph.edges.t().tolist():
        neighbours[u].append(v)
    owner = _grow(neighbours, num_parts)
    _propagate(neighbours, owner, num_parts, imbalance, num_passes)
    return torch.tensor(owner, dtype=torch.int64, device=graph.edges.device)


def _grow(neighbours: list[list[int]], num_parts: int) -> list[int]:
    """Greedy BFS growth: parts of equal size (to one node), each grown from the unassigned
    node of highest degree."""
    n = len(neighbours)
    order = sorted(range(n), key=lambda u: -len(neighbours[u]))  # seeds: highest degree first
    owner = [-1] * n
    base, extra = divmod(n, num_parts)
    cursor = 0
    for part in range(num_parts):
        target, size, queue = base + (1 if part < extra else 0), 0, deque[int]()
        while size < target:
            if not queue:
                while owner[order[cursor]] != -1:
                    cursor += 1
                queue.append(order[cursor])
            u = queue.popleft()
            if owner[u] != -1:
                continue
            owner[u], size = part, size + 1
            queue.extend(v for v in neighbours[u] if owner[v] == -1)
    return owner


def _propagate(
    neighbours: list[list[int]], owner: list[int], num_parts: int, imbalance: float, passes: int
) -> None:
    """Balanced label propagation, in place: a node moves to the part holding strictly more of
    its neighbours than its own does (ties to the lowest part) if that part is below its cap
    and its own above its floor. Each move cuts fewer edges, so the cut only falls."""
    share = len(owner) / num_parts
    cap, floor = math.floor(share * (1 + imbalance)) + 1, math.ceil(share * (1 - imbalance)) - 1
    sizes = Counter(owner)
    for _ in range(passes):
        moved = 0
        for u, here in enumerate(owner):
            counts = Counter(owner[v] for v in neighbours[u])
            if not counts:
                continue
            best, votes = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
            if votes > counts.get(here, 0) and sizes[best] < cap and sizes[here] > floor:
                owner[u] = best
                sizes[here], sizes[best] = sizes[here] - 1, sizes[best] + 1
                moved += 1
        if not moved:
            break


def cut_edges(graph: Graph, owner: torch.Tensor) -> int:
    """Undirected edges whose ends lie in different parts."""
    return int((owner[graph.edges[0]] != owner[graph.edges[1]]).sum()) // 2


def halo_plan(
    adjacency: torch.Tensor, owner: torch.Tensor, rank: int, world: int
) -> tuple[HaloPlan, torch.Tensor]:
    """Rank ``rank``'s ``HaloPlan`` for ``adjacency`` (sparse ``[N, N]``, symmetric pattern)
    under ``owner``, and its nodes' global ids (sorted: local row ``i`` is node ``nodes[i]``).

    Raises:
        ValueError: ``owner`` names a part outside ``[0, world)``.
    """
    if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= world):
        raise ValueError(
            f"owner must name parts in [0, {world}), got {sorted(set(owner.tolist()))}"
        )
    adjacency = adjacency.coalesce()
    rows, cols = adjacency.indices()
    values = adjacency.values()
    local_of = torch.full((owner.numel(),), -1, dtype=torch.int64, device=owner.device)
    per_part = [torch.nonzero(owner == j).flatten() for j in range(world)]
    for nodes in per_part:
        local_of[nodes] = torch.arange(nodes.numel(), device=owner.device)
    nodes = per_part[rank]
    n_local = nodes.numel()
    mine = owner[rows] == rank
    send_rows, recv_counts, halo_adj = [], [], []
    local_adj = values.new_empty(0)
    for j in range(world):
        into = mine & (owner[cols] == j)  # my rows' edges to j's nodes
        r, c, v = local_of[rows[into]], cols[into], values[into]
        if j == rank:
            local_adj = torch.sparse_coo_tensor(
                torch.stack([r, local_of[c]]), v, (n_local, n_local)
            )
            send_rows.append(owner.new_empty(0))
            recv_counts.append(0)
            halo_adj.append(torch.sparse_coo_tensor(owner.new_empty((2, 0)), v[:0], (n_local, 0)))
            continue
        halo, position = torch.unique(c, return_inverse=True)  # sorted global ids
        recv_counts.append(int(halo.numel()))
        halo_adj.append(
            torch.sparse_coo_tensor(torch.stack([r, position]), v, (n_local, halo.numel()))
        )
        # What j needs of mine: my nodes adjacent to j's (the pattern is symmetric), by global id.
        out = (owner[rows] == j) & (owner[cols] == rank)
        send_rows.append(local_of[torch.unique(cols[out])])
    plan = HaloPlan(
        send_rows=send_rows,
        recv_counts=recv_counts,
        local_adj=local_adj.coalesce(),
        halo_adj=[a.coalesce() for a in halo_adj],
    )
    return plan, nodes

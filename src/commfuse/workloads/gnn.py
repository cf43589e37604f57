"""Graph neural networks trained full-graph on a node-partitioned graph: node classification
on ``graph.py``'s planted communities, every aggregation ``commfuse.fused.graph_halo``'s.

- ``GCN`` (Kipf and Welling, ICLR 2017): ``H' = relu(A_hat (H W))``, the last layer without the
  relu, ``A_hat`` GCN's normalised adjacency (``normalized_adjacency(graph)``). Transforming
  first keeps the exchanged boundary rows ``d_out`` wide.
- ``GraphSAGE`` (Hamilton, Ying and Leskovec, NeurIPS 2017) with the mean aggregator:
  ``H' = relu(H W_self + M (H W_neigh))``, ``M = D^-1 A`` the neighbours' mean
  (``normalized_adjacency(graph, kind="mean")``); full neighbourhoods, no sampling.

Rank ``r`` holds its nodes' rows of ``H``; ``halo_aggregate`` exchanges only the boundary rows.
The weights are replicated: ``train_step`` sums their gradients over ranks (the loss is the sum
over a rank's training nodes divided by the graph's), so a step equals the single-process
full-graph step, exactly in ``Exact`` mode. Each layer keeps its own ``HaloState`` (``Stale``
and ``Sample`` carry it).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.collectives import all_reduce
from commfuse.comm import Communicator
from commfuse.fused.graph_halo import HaloMode, HaloPlan, HaloState, halo_aggregate


def _check_dims(dims: list[int]) -> None:
    if len(dims) < 2 or any(d < 1 for d in dims):
        raise ValueError(f"dims needs >= 2 positive widths (input first), got {dims}")


def _weights(
    dims: list[int], comm: Communicator, dtype: torch.dtype, gen: torch.Generator
) -> nn.ParameterList:
    """One ``[a, b]`` weight per layer, drawn on the host (the same on every rank), then moved."""
    return nn.ParameterList(
        nn.Parameter(
            (torch.randn(a, b, generator=gen, dtype=torch.float64, device="cpu") / a**0.5).to(
                device=comm.device, dtype=dtype
            )
        )
        for a, b in itertools.pairwise(dims)
    )


class FullGraphModel(nn.Module):
    """What the models share: the graph's plan, the mode and a ``HaloState`` per layer, the loss
    over a rank's training nodes and the SGD step that sums the replicated weights' gradients
    over ranks."""

    def __init__(
        self, comm: Communicator, plan: HaloPlan, dims: list[int], mode: HaloMode | None
    ) -> None:
        super().__init__()
        _check_dims(dims)
        self.comm, self.plan, self.mode = comm, plan, mode
        self.states = [HaloState() for _ in itertools.pairwise(dims)]

    def loss(
        self, x: torch.Tensor, labels: torch.Tensor, train: torch.Tensor, num_train: int
    ) -> torch.Tensor:
        """This rank's share of the mean cross-entropy over all ``num_train`` training nodes:
        the sum over its own (``train``, a mask of its nodes) divided by ``num_train``."""
        logits = self(x)
        return F.cross_entropy(logits[train], labels[train], reduction="sum") / num_train

    def train_step(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        train: torch.Tensor,
        num_train: int,
        *,
        lr: float,
    ) -> float:
        """One SGD step of the full graph; returns the global loss (the same on every rank)."""
        params = list(self.parameters())
        for w in params:
            w.grad = None
        loss = self.loss(x, labels, train, num_train)
        torch.autograd.backward(loss)
        flat = torch.cat(
            [loss.detach().reshape(1)]
            + [(w.grad if w.grad is not None else torch.zeros_like(w)).reshape(-1) for w in params]
        )
        all_reduce(self.comm, flat, "sum")
        offset = 1
        with torch.no_grad():
            for w in params:
                w.sub_(lr * flat[offset : offset + w.numel()].view_as(w))
                offset += w.numel()
        return float(flat[0])


class GCN(FullGraphModel):
    """A GCN over this rank's share of the graph.

    Args:
        comm: the group the graph is partitioned over.
        plan: this rank's ``HaloPlan`` (``graph.halo_plan`` of ``normalized_adjacency(graph)``).
        dims: feature widths, input first: ``[F, hidden, classes]`` is a 2-layer GCN.
        mode: the halo exchange's mode (``Exact()`` by default), the same on every rank.
        dtype: of the weights.
        seed: every rank draws the same weights from it.

    Example::

        model = GCN(comm, plan, [16, 32, 8], mode=Stale())
        logits = model(features[nodes])  # this rank's nodes
    """

    def __init__(
        self,
        comm: Communicator,
        plan: HaloPlan,
        dims: list[int],
        *,
        mode: HaloMode | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__(comm, plan, dims, mode)
        gen = torch.Generator().manual_seed(seed)
        self.weights = _weights(dims, comm, dtype, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[n_local, classes]`` of this rank's nodes from their features ``x``."""
        h = x
        for i, (weight, state) in enumerate(zip(self.weights, self.states, strict=True)):
            h = halo_aggregate(self.comm, self.plan, h @ weight, mode=self.mode, state=state)
            if i < len(self.weights) - 1:
                h = torch.relu(h)
        return h


class GraphSAGE(FullGraphModel):
    """GraphSAGE with the mean aggregator over this rank's share of the graph.

    Args:
        comm: the group the graph is partitioned over.
        plan: this rank's ``HaloPlan`` of the mean adjacency
            (``graph.halo_plan`` of ``normalized_adjacency(graph, kind="mean")``).
        dims: feature widths, input first: ``[F, hidden, classes]`` is a 2-layer model.
        mode: the halo exchange's mode (``Exact()`` by default), the same on every rank.
        dtype: of the weights.
        seed: every rank draws the same weights from it.

    Example::

        model = GraphSAGE(comm, plan, [16, 32, 8], mode=Sample(p=0.1))
        logits = model(features[nodes])  # this rank's nodes
    """

    def __init__(
        self,
        comm: Communicator,
        plan: HaloPlan,
        dims: list[int],
        *,
        mode: HaloMode | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__(comm, plan, dims, mode)
        gen = torch.Generator().manual_seed(seed)
        self.self_weights = _weights(dims, comm, dtype, gen)
        self.neighbour_weights = _weights(dims, comm, dtype, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[n_local, classes]`` of this rank's nodes from their features ``x``."""
        h = x
        layers = zip(self.self_weights, self.neighbour_weights, self.states, strict=True)
        for i, (w_self, w_neigh, state) in enumerate(layers):
            mean = halo_aggregate(self.comm, self.plan, h @ w_neigh, mode=self.mode, state=state)
            h = h @ w_self + mean
            if i < len(self.states) - 1:
                h = torch.relu(h)
        return h

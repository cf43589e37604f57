"""A graph convolutional network (Kipf and Welling, ICLR 2017) trained full-graph on a
node-partitioned graph: node classification on ``graph.py``'s planted communities.

Each layer is ``H' = relu(A_hat (H W))``, the last without the relu, with ``A_hat`` GCN's
normalised adjacency. Rank ``r`` holds its nodes' rows of ``H``; the aggregation
``A_hat @ (H W)`` is ``commfuse.fused.graph_halo.halo_aggregate``, which exchanges only the
boundary rows (transforming first keeps them ``d_out`` wide). The weights are replicated:
``GCN.train_step`` sums their gradients over ranks (the loss is the sum over a rank's training
nodes divided by the graph's), so a step equals the single-process full-graph step, exactly in
``Exact`` mode. Each layer keeps its own ``HaloState`` (``Stale`` and ``Sample`` carry it).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from commfuse.collectives import all_reduce
from commfuse.comm import Communicator
from commfuse.fused.graph_halo import HaloMode, HaloPlan, HaloState, halo_aggregate


class GCN(nn.Module):
    """A GCN over this rank's share of the graph.

    Args:
        comm: the group the graph is partitioned over.
        plan: this rank's ``HaloPlan`` (``graph.halo_plan``).
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
        super().__init__()
        if len(dims) < 2 or any(d < 1 for d in dims):
            raise ValueError(f"dims needs >= 2 positive widths (input first), got {dims}")
        self.comm, self.plan, self.mode = comm, plan, mode
        gen = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList(
            nn.Parameter(
                (torch.randn(a, b, generator=gen, dtype=torch.float64, device="cpu") / a**0.5).to(
                    device=comm.device, dtype=dtype
                )
            )
            for a, b in itertools.pairwise(dims)
        )
        self.states = [HaloState() for _ in self.weights]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[n_local, classes]`` of this rank's nodes from their features ``x``."""
        h = x
        for i, (weight, state) in enumerate(zip(self.weights, self.states, strict=True)):
            h = halo_aggregate(self.comm, self.plan, h @ weight, mode=self.mode, state=state)
            if i < len(self.weights) - 1:
                h = torch.relu(h)
        return h

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
        self.zero_grad(set_to_none=False)
        loss = self.loss(x, labels, train, num_train)
        torch.autograd.backward(loss)
        flat = torch.cat(
            [loss.detach().reshape(1)]
            + [w.grad.reshape(-1) for w in self.weights if w.grad is not None]
        )
        all_reduce(self.comm, flat, "sum")
        offset = 1
        with torch.no_grad():
            for w in self.weights:
                w -= lr * flat[offset : offset + w.numel()].view_as(w)
                offset += w.numel()
        return float(flat[0])

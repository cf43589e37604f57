"""Gossip averaging (D-PSGD): each rank averages its model with its neighbours', no all-reduce.

Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case Study for
Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017. With a symmetric, doubly
stochastic mixing matrix W(t) (``topology.py``), every rank i, every ``every`` steps:

1. takes its local optimizer step on its own gradient (the caller's optimizer);
2. sends its model x_i to each neighbour and receives theirs (``exchange.py``: receives and
   sends all posted before any wait, so no order of ranks can deadlock);
3. replaces x_i by sum_j W(t)[i, j] x_j.

The average over ranks moves only by the gradients, and with no gradient the spread around it
shrinks by W's second-largest singular value each round (on a fixed graph); a sparse graph
costs a rank deg(i) models per round instead of an all-reduce's ~2 (P - 1) / P, spread over
its neighbours' links. ``shift_one`` sends one model per rank per round. D-PSGD mixes after the
local step (Lian et al.'s Algorithm 1 mixes the pre-step model; the two differ by when the
gradient enters, not by what is averaged).

How to tune: ``every`` trades bytes against consensus (local SGD's H); the ring mixes slowly
on many ranks (its spectral gap falls as 1/P^2), the exponential graph and ``shift_one`` mix in
about log2 P rounds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from commfuse.comm import Communicator
from commfuse.decentral.exchange import FlatParams, check_same_model, exchange
from commfuse.decentral.topology import Edges, Topology


class Rounds:
    """What every gossip method shares: the flat model, the step clock, the round counter.

    Raises:
        ValueError: ``every`` < 1, a topology for another world size, or parameters that
            cannot travel as one flat vector (``FlatParams``).
        InconsistentInputError: ranks hold models of different shapes or dtypes (checked once,
            here, with one small all-gather).
    """

    #: The kind the exchanged messages count under in ``comm.stats``.
    label = "gossip"

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        topology: Topology,
        *,
        every: int = 1,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1 step, got {every}")
        if topology.world_size != comm.world_size:
            raise ValueError(
                f"{topology!r} is for {topology.world_size} ranks but the communicator "
                f"{comm.name!r} has {comm.world_size}"
            )
        self.comm, self.topology, self.every = comm, topology, every
        self.flat = FlatParams(params)
        self.steps = 0
        """Calls of ``step`` so far."""
        self.rounds = 0
        """Gossip rounds so far: the t of the next round's W(t)."""
        check_same_model(comm, self.flat, f"{type(self).__name__} on rank {comm.rank}")

    def step(self) -> bool:
        """Count one training step (after the optimizer's) and mix every ``every`` steps.

        Returns:
            Whether this step mixed.
        """
        self.steps += 1
        if self.steps % self.every:
            return False
        self.mix()
        return True

    def mix(self) -> None:
        """One gossip round now, with W(``self.rounds``); nothing is sent on one rank."""
        edges = self.topology.edges(self.rounds, self.comm.rank)
        if self.comm.world_size > 1:
            with self.comm.at_step(self.steps):
                self._mix(edges)
        self.rounds += 1

    def _mix(self, edges: Edges) -> None:
        raise NotImplementedError

    def numerator(self) -> torch.Tensor:
        """This rank's share of the sum the rounds keep (its flat model; PushSum's w_i z_i)."""
        return self.flat.gather()

    def average_all(self) -> None:
        """Replace every rank's model by the exact average of the replicas (one all-reduce of
        the model): the consensus the rounds approach, as the papers evaluate it."""
        total = self.numerator()
        self.comm.all_reduce(total, "sum")
        self.flat.scatter(total / self.comm.world_size)

    def state_dict(self) -> dict[str, Any]:
        """The clock: enough, with the model, for an exact resume."""
        return {"steps": self.steps, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])


class GossipAveraging(Rounds):
    """D-PSGD's gossip averaging of ``params`` over ``topology`` every ``every`` steps.

    Args:
        params: this rank's model parameters (one dtype, one device); mixed in place.
        comm: the communicator of the ranks that gossip.
        topology: a topology for ``comm.world_size`` ranks whose W(t) is doubly stochastic:
            ``Ring``, ``Torus``, ``ShiftOne``, ``Exponential`` (a shift: doubly stochastic,
            though directed), or such ``Explicit`` matrices.
        every: mix after every ``every``-th call of ``step``.

    Raises:
        ValueError: a topology whose W(t) is not doubly stochastic (use ``PushSum``), or
            what ``Rounds`` refuses.
        InconsistentInputError: ranks hold models of different shapes or dtypes.

    Example:
        ```python
        gossip = GossipAveraging(model.parameters(), comm, ShiftOne(comm.world_size))
        for x, y in batches:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            gossip.step()
        ```
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        topology: Topology,
        *,
        every: int = 1,
    ) -> None:
        if not topology.doubly_stochastic:
            raise ValueError(
                f"{topology!r}'s W(t) is only column-stochastic: gossip averaging would drift "
                "from the average; use PushSum on it"
            )
        super().__init__(params, comm, topology, every=every)

    def _mix(self, edges: Edges) -> None:
        self.flat.scatter(exchange(self.comm, self.flat.gather(), edges, label=self.label))

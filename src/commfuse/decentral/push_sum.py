"""PushSum and Stochastic Gradient Push (SGP) on directed, time-varying graphs.

Assran, Loizou, Ballas and Rabbat, "Stochastic Gradient Push for Distributed Deep Learning",
ICML 2019, after Kempe, Dobra and Gehrke's push-sum (FOCS 2003). A directed graph's W(t) is
only column-stochastic (what a rank gives away sums to 1, what it receives need not), so plain
gossip would drift to a weighted average. PushSum carries a weight w_i beside each numerator
x_i, mixes both with the same W(t), and reads the de-biased model z_i = x_i / w_i:

1. the caller's optimizer steps on z_i (the parameters hold z_i between rounds);
2. x_i = w_i z_i; the message [x_i, w_i] goes to each out-peer (one message per peer);
3. x_i <- sum_j W(t)[i, j] x_j and w_i <- sum_j W(t)[i, j] w_j;
4. z_i = x_i / w_i is written back into the parameters.

Column-stochastic W(t) keeps sum_i w_i = n and sum_i x_i at every round; on a graph whose
union over a period is strongly connected, every z_i goes to the ranks' average (with no
gradient, of the initial models). On SGP's exponential graph every rank receives exactly one message a round,
so W(t) is doubly stochastic too and w_i stays 1: SGP's Algorithm 1 exactly. On an irregular
graph the weights move, and the step of 1. is taken on z_i where Algorithm 1 subtracts the
gradient from x_i: the update is scaled by w_i.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from commfuse.comm import Communicator
from commfuse.decentral.exchange import exchange
from commfuse.decentral.gossip import Rounds
from commfuse.decentral.topology import Edges, Topology


class PushSum(Rounds):
    """PushSum / SGP averaging of ``params`` over ``topology`` every ``every`` steps.

    Args:
        params: this rank's de-biased model z_i (one dtype, one device); updated in place.
        comm: the communicator of the ranks that gossip.
        topology: any topology for ``comm.world_size`` ranks; a directed one (``Exponential``,
            ``Explicit``) is what PushSum is for.
        every: mix after every ``every``-th call of ``step``.

    Raises:
        ValueError: what ``Rounds`` refuses (``every`` < 1, another world size, mixed dtypes).
        InconsistentInputError: ranks hold models of different shapes or dtypes.

    Example:
        ```python
        sgp = PushSum(model.parameters(), comm, Exponential(comm.world_size))
        for x, y in batches:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sgp.step()
        print(float(sgp.weight))  # this rank's push-sum weight w_i
        ```
    """

    label = "push_sum"

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        topology: Topology,
        *,
        every: int = 1,
    ) -> None:
        super().__init__(params, comm, topology, every=every)
        self.weight = torch.ones(1, dtype=self.flat.dtype, device=self.flat.device)
        """The push-sum weight w_i (the sum over ranks is the world size)."""

    def _mix(self, edges: Edges) -> None:
        message = torch.cat([self.flat.gather() * self.weight, self.weight])
        mixed = exchange(self.comm, message, edges, label=self.label)
        self.weight = mixed[-1:].clone()
        self.flat.scatter(mixed[:-1] / self.weight)

    def numerator(self) -> torch.Tensor:
        return self.flat.gather() * self.weight

    def average_all(self) -> None:
        """The exact average (sum_i x_i / n, since the weights sum to n); the weight is 1 after."""
        super().average_all()
        self.weight = torch.ones_like(self.weight)

    def state_dict(self) -> dict[str, Any]:
        """The clock and the weight: with the model (z_i), enough for an exact resume."""
        return {**super().state_dict(), "weight": self.weight.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.weight = state["weight"].to(dtype=self.flat.dtype, device=self.flat.device).clone()

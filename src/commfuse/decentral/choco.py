"""CHOCO-Gossip: gossip averaging with compressed messages that still reaches consensus.

Koloskova, Stich and Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms with
Compressed Communication", ICML 2019. Compressing x_j itself would leave an error that never
goes away; CHOCO compresses the change of a public copy instead. Every rank i keeps its model
x_i, its public copy x^_i (what its neighbours know of it, 0 at the start) and
s_i = sum_j W[i, j] x^_j (the neighbours' copies, mixed; itself included). Each round:

1. q_i = Q(x_i - x^_i) with a commfuse ``MessageCompressor`` (int8, int4, QSGD, sign,
   top-k, ...); the packed message goes to every neighbour (its ``wire_bytes`` each);
2. x^_i += q_i and s_i += W[i, i] q_i + sum_j W[i, j] q_j, from the messages received;
3. x_i += gamma (s_i - x^_i).

What Q drops stays in x_i - x^_i and is sent in later rounds: the public copy is the error
feedback. With a doubly stochastic W the mean of the x_i never moves, and with an exact Q and
gamma = 1 a round is exactly gossip averaging. s_i is kept instead of every neighbour's copy,
which needs a fixed W: ``Ring`` and ``Torus``. The paper tunes the consensus step gamma to the
compressor (smaller for coarser Q).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from commfuse.comm import Communicator
from commfuse.compress.message import MessageCompressor
from commfuse.decentral.exchange import swap
from commfuse.decentral.gossip import Rounds
from commfuse.decentral.topology import Edges, Topology


class ChocoGossip(Rounds):
    """CHOCO-Gossip of ``params`` over a fixed ``topology`` with ``compressor`` (module
    docstring).

    Args:
        params: this rank's model parameters (one dtype, one device); updated in place.
        comm: the communicator of the ranks that gossip.
        topology: a fixed (period 1), doubly stochastic topology: ``Ring``, ``Torus``.
        compressor: a ``commfuse.compress`` compressor with a message of its own
            (``Int8()``, ``TopK(ratio=0.01)``, ...); its own error feedback is not used.
        gamma: the consensus step size, in (0, 1].
        every: mix after every ``every``-th call of ``step``.

    Raises:
        ValueError: a time-varying or not doubly stochastic topology, a compressor without
            a message (PowerSGD, the casts), ``gamma`` outside (0, 1], or what ``Rounds``
            refuses.
        InconsistentInputError: ranks hold models of different shapes or dtypes.

    Example:
        ```python
        choco = ChocoGossip(model.parameters(), comm, Ring(comm.world_size), Int8(), gamma=0.5)
        for x, y in batches:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            choco.step()
        ```
    """

    label = "choco"

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        comm: Communicator,
        topology: Topology,
        compressor: MessageCompressor,
        *,
        gamma: float,
        every: int = 1,
    ) -> None:
        if topology.period != 1 or not topology.doubly_stochastic:
            raise ValueError(
                f"CHOCO keeps sum_j W[i, j] x^_j, which needs one doubly stochastic W for every "
                f"round; {topology!r} changes or is not doubly stochastic (use Ring or Torus)"
            )
        if not isinstance(compressor, MessageCompressor):
            raise ValueError(
                f"CHOCO sends each rank's own compressed message; {type(compressor).__name__} "
                "has none (use int8, int4, qsgd, sign, topk, ...)"
            )
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        super().__init__(params, comm, topology, every=every)
        self.compressor, self.gamma = compressor, gamma
        zeros = torch.zeros(self.flat.numel, dtype=self.flat.dtype, device=self.flat.device)
        self.public = zeros
        """x^_i: this rank's public copy, what its neighbours know of it."""
        self.mixed = zeros.clone()
        """s_i = sum_j W[i, j] x^_j."""

    def _mix(self, edges: Edges) -> None:
        numel, dtype, step = self.flat.numel, self.flat.dtype, self.rounds
        layout = self.compressor.layout(numel, dtype, step)
        x = self.flat.gather()
        parts = self.compressor.compress(x - self.public, step=step, rank=self.comm.rank)
        received = swap(self.comm, layout.pack(parts), edges, label=self.label)
        q = self.compressor.decompress(parts, numel, dtype, step)
        self.public += q
        self.mixed.add_(q, alpha=edges.keep)
        for words, weight in received:
            theirs = self.compressor.decompress(layout.unpack(words), numel, dtype, step)
            self.mixed.add_(theirs, alpha=weight)
        self.flat.scatter(x.add_(self.mixed - self.public, alpha=self.gamma))

    def state_dict(self) -> dict[str, Any]:
        """The clock and the two copies: with the model, enough for an exact resume."""
        return {**super().state_dict(), "public": self.public.clone(), "mixed": self.mixed.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.public = state["public"].to(self.flat.device, self.flat.dtype).clone()
        self.mixed = state["mixed"].to(self.flat.device, self.flat.dtype).clone()

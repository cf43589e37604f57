"""Decentralized strategies: a ``commfuse.decentral.DecentralMethod`` (``GossipConfig``,
``PushSumConfig``) run under the training loop.

The model is not wrapped: every rank takes its optimizer's step on its own gradient, then the
method's averaging object counts the step and, every ``every`` steps, mixes the model with its
topology's neighbours (``commfuse/decentral/gossip.py``, ``push_sum.py``); ``finish`` averages
the replicas once (``final_average``). On the command
line: ``gossip:topology=ring,every=4``, ``push-sum:topology=exponential``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from commfuse.decentral import DecentralMethod, GossipConfig, PushSum, PushSumConfig
from commfuse.train.strategy import Strategy, StrategyContext, register_builder


class Decentral(Strategy):
    """One rank of a gossip or push-sum run."""

    def __init__(self, config: DecentralMethod, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        params = [p for p in ctx.module.parameters() if p.requires_grad]
        self.gossip = config.build(params, ctx.comm)
        self.final_average = config.final_average
        self._communicate = True
        # The one shape check at build time is set-up, not an exchange.
        self._built_bytes = self._all_bytes()
        self.final_sync_bytes = 0
        """Bytes of the end-of-training average (``finish()``)."""

    @property
    def model(self) -> nn.Module:
        return self.module

    def optimizer_step(self) -> bool:
        self.optimizer.step()
        if self._communicate:
            self.gossip.step()
        return True

    def _all_bytes(self) -> int:
        total = self.comm.stats.total()
        return total.bytes_sent + total.handed_bytes

    def bytes_sent(self) -> int:
        """The exact point-to-point bytes of the rounds (the models sent to peers)."""
        return self._all_bytes() - self._built_bytes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._communicate = False
        try:
            yield
        finally:
            self._communicate = True

    def finish(self) -> None:
        if self.final_average:
            before = self._all_bytes()
            self.gossip.average_all()
            self.final_sync_bytes += self._all_bytes() - before

    def metrics(self) -> dict[str, Any]:
        """Rounds mixed, the push-sum weight of this rank (1 for gossip) before the final
        average, and that average's bytes."""
        weight = float(self.gossip.weight) if isinstance(self.gossip, PushSum) else 1.0
        return {
            "gossip_rounds": self.gossip.rounds,
            "push_sum_weight": weight,
            "final_sync_bytes": self.final_sync_bytes,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"gossip": self.gossip.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "gossip" not in state:
            raise ValueError("checkpoint has no gossip state (the round counter)")
        self.gossip.load_state_dict(state["gossip"])


register_builder(GossipConfig, Decentral)
register_builder(PushSumConfig, Decentral)

"""Strategies that communicate less often: a ``commfuse.localsgd.PeriodicSyncConfig``
(``local_sgd(H=8)``, ``post_local_sgd``, ``slowmo``, ``diloco``, ``streaming_diloco``) run by
``PeriodicSyncOptimizer`` under the training loop.

The model is not wrapped: between synchronisations each rank trains its own replica, and the
optimizer step performs whatever exchange is due (see ``commfuse/localsgd/optimizer.py``). On
the command line the keys are the functions' arguments (``diloco:H=50,outer_lr=0.7``,
``streaming-diloco:H=50,num_fragments=4``, ``local-sgd:H=8,compressor=int8``,
``hierarchical=1``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from commfuse.localsgd import PeriodicSyncConfig, PeriodicSyncOptimizer
from commfuse.train.strategy import Strategy, StrategyContext, register_builder


class PeriodicSync(Strategy):
    """One rank of a local-SGD-family run."""

    def __init__(self, config: PeriodicSyncConfig, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.periodic = PeriodicSyncOptimizer(ctx.optimizer, ctx.module, ctx.comm, config)
        self._communicate = True
        self.final_sync_bytes = 0
        """Bytes this rank sent in the end-of-training synchronisation (``finish()``)."""

    @property
    def model(self) -> nn.Module:
        return self.module

    def optimizer_step(self) -> bool:
        if self._communicate:
            self.periodic.step()
        else:
            self.optimizer.step()
        return True

    def bytes_sent(self) -> int:
        comms = {id(c): c for c in (self.comm, self.periodic.grad_comm, self.periodic.outer_comm)}
        total = 0
        for comm in comms.values():
            total += comm.stats.total().handed_bytes  # as the DDP strategies (commfuse_dp.py)
        return total

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._communicate = False
        try:
            yield
        finally:
            self._communicate = True

    def metrics(self) -> dict[str, Any]:
        """Drift between replicas before each synchronisation (L2, and relative to the model)."""
        syncs = self.periodic.syncs
        return {
            "syncs": len(syncs),
            "drift": [s.drift for s in syncs],
            "relative_drift": [s.relative_drift for s in syncs],
            "final_sync_bytes": self.final_sync_bytes,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"periodic": self.periodic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "periodic" not in state:
            raise ValueError("checkpoint has no local-SGD state (anchors, outer momentum)")
        self.periodic.load_state_dict(state["periodic"])

    def finish(self) -> None:
        self.periodic.land_in_flight()
        if self.periodic.config.final_sync:
            before = self.bytes_sent()
            self.periodic.average_moved_fragments()
            self.final_sync_bytes += self.bytes_sent() - before


register_builder(PeriodicSyncConfig, PeriodicSync)

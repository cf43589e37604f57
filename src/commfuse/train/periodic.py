"""Strategies that communicate less often: ``localsgd``, ``postlocal``, ``slowmo``, ``diloco`` and
``streaming-diloco`` (``commfuse.localsgd.PeriodicSyncOptimizer`` under the training loop).

The model is not wrapped: between synchronisations each rank trains its own replica, and the
optimizer step performs whatever exchange is due (see ``commfuse/localsgd/optimizer.py``).
Options are the presets' own (``diloco:H=50,outer_lr=0.7,outer_momentum=0.9``,
``streaming-diloco:H=50,fragments=4``, ``localsgd:H=8,compress=int8``, ``hierarchical=1``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch import nn

from commfuse.localsgd import PRESETS, PeriodicSyncOptimizer, config_from_preset
from commfuse.train.strategy import Strategy, StrategyContext, register_strategy
from commfuse.workloads.options import parse_spec


class PeriodicSync(Strategy):
    """One rank of a local-SGD-family run."""

    def __init__(self, spec: str, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        name, raw = parse_spec(spec, what="strategy")
        config = config_from_preset(name, raw)
        if config.hierarchical:
            # The launcher's host layout: ranks of one host average gradients every step.
            config.ranks_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
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


def _validate(spec: str) -> None:
    name, raw = parse_spec(spec, what="strategy")
    config_from_preset(name, raw)


_HELP = {
    "localsgd": "local SGD (Stich 2019): average the replicas every H steps (H=8)",
    "postlocal": "post-local SGD (Lin et al. 2020): synchronous for `warmup` steps, then local SGD",
    "slowmo": "SlowMo (Wang et al. 2020): local SGD with a slow outer momentum beta",
    "diloco": "DiLoCo (Douillard et al. 2023): inner AdamW for H steps, outer Nesterov SGD",
    "streaming-diloco": "streaming DiLoCo: fragments synced at staggered steps, exchange overlapped",
}

for _name in PRESETS:
    register_strategy(
        _name,
        None,
        lambda spec, ctx: PeriodicSync(spec, ctx),
        help=_HELP[_name],
        validate=_validate,
    )

"""SelSync: synchronise only the steps whose gradient changed significantly.

Tyagi and Swany, "Accelerating Distributed ML Training via Selective Synchronization" (IEEE
Cluster 2023, arXiv 2307.07950). Every rank trains its own replica; at each step:

1. each rank smooths the L2 norm of its gradient, ``s_t = beta s_{t-1} + (1 - beta) |g_t|``
   (the first step: ``s_1 = |g_1|``), and computes its relative change
   ``delta_t = |s_t - s_{t-1}| / s_{t-1}`` (0 on the first step, where the replicas are
   still equal);
2. each rank sets a flag, ``delta_t >= threshold``, and one allreduce (max) of the flags (one
   integer) decides, identically on every rank, whether this step synchronises: it does when
   any rank saw a significant change;
3. every rank takes its inner step; on a synchronising step the replicas are then replaced by
   their average (parameter aggregation, as the paper prefers to gradient aggregation: it also
   reconciles the drift of the local steps before it), else the step stays local. With
   ``outer="nesterov"`` the average is taken as DiLoCo's pseudo-gradient instead, and the
   replicas restart from DiLoCo's outer Nesterov step on it (``outer.py``).

``threshold = 0`` synchronises every step: local SGD with H = 1. A larger threshold syncs
less; the paper tunes it per model (large changes of the gradient come early in training and
after learning-rate changes, where synchronising matters most). Tune ``threshold`` by the
fraction of steps that synchronise (``len(optimizer.syncs) / steps``) and ``smoothing``
toward 1 for noisy gradients (small batches per replica).

Bytes per rank: 8 per step for the flag, plus the model (``4 N`` in fp32, or the compressor's
message) on each synchronising step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from commfuse.localsgd.sync_method import (
    AGREE_BYTES,
    ExchangeSettingsWithOuterStep,
    SyncMethodOptimizer,
    agree,
)


@dataclass(frozen=True, kw_only=True)
class SelSyncConfig(ExchangeSettingsWithOuterStep):
    """SelSync (Tyagi and Swany 2023): average the replicas on the steps where some rank's
    smoothed gradient norm changed by at least ``threshold`` (relative)."""

    name = "selsync"

    threshold: float = 0.05
    """delta: the relative change of the smoothed gradient norm that makes a step synchronise
    (0: every step)."""
    smoothing: float = 0.9
    """beta of the exponential moving average of the gradient norm (0: no smoothing)."""

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if not 0 <= self.smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {self.smoothing}")
        self.periodic()  # the shared settings' own checks


class SelSyncOptimizer(SyncMethodOptimizer[SelSyncConfig]):
    """SelSync's optimizer (see the module docstring); ``syncs`` lists the steps that
    synchronised, ``control_bytes`` what the flags cost."""

    def _start(self) -> None:
        self.smoothed_norm: float | None = None
        """This rank's smoothed gradient norm (differs between ranks)."""

    def significant_change(self) -> bool:
        """Update the smoothed gradient norm and say whether it changed by >= threshold."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        previous = self.smoothed_norm
        beta = self.method.smoothing
        self.smoothed_norm = norm if previous is None else beta * previous + (1 - beta) * norm
        # No earlier norm to compare with (the first step: the replicas start equal, nothing to
        # reconcile): no change, which only threshold 0 synchronises.
        change = 0.0 if not previous else abs(self.smoothed_norm - previous) / previous
        return bool(change >= self.method.threshold)

    def step(self) -> None:
        """Decide (one flag allreduce), take the inner step, average when decided."""
        sync = agree(self.outer_comm, int(self.significant_change()), "max", like=self.params[0])
        if self.outer_comm.world_size > 1:
            self.control_bytes += AGREE_BYTES
        self._inner_step(self.config.inner_lr_scale)
        self.step_count += 1
        if sync:
            self._start_exchange(0, background=False)
            self._apply_arrived()

    def state_dict(self) -> dict[str, Any]:
        """The shared state, and the smoothed gradient norm and the flags' bytes."""
        state = super().state_dict()
        state["selsync"] = {
            "smoothed_norm": self.smoothed_norm,
            "control_bytes": self.control_bytes,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state["selsync"]
        self.smoothed_norm = own["smoothed_norm"]
        self.control_bytes = int(own["control_bytes"])


SelSyncConfig.optimizer_class = SelSyncOptimizer

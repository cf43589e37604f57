"""SelSync: synchronise only the steps whose gradient changed significantly.

Tyagi and Swany, "Accelerating Distributed ML Training via Selective Synchronization" (IEEE
Cluster 2023, arXiv 2307.07950). Every rank trains its own replica; at each step t:

1. each rank takes the L2 norm of its gradient, ``n_t = |g_t|``, and smooths it over the last
   w steps (``smoothing_steps``) with the paper's weighted moving average,
   ``s_t = sum_k (1 - a)^k n_(t+1-k) / sum_k (1 - a)^k`` for k = 1 .. w (the newest weighted
   most; ``a`` is ``smoothing_decay``, 0 a plain mean; fewer than w terms while the run is
   younger than w steps);
2. it takes the relative change of the smoothed norm, ``c_t = |s_t - s_(t-1)| / s_(t-1)``
   (none on the first step), and smooths that again over the last w changes with the same
   weights: the signal ``delta_t`` is the weighted mean of ``c``, the paper's "relative
   gradient change" once both averages are full;
3. one allreduce (max) of one integer, ``delta_t`` in fixed point (``SIGNAL_SCALE``), gives
   every rank the same signal, the largest change any rank saw (``signals``); the step
   synchronises when it is at least ``threshold``, identically on every rank, and on every
   step before the w-th, whatever the signal: the paper synchronises while its averages have
   no history (bulk-synchronous training for the first window);
4. every rank takes its inner step; on a synchronising step the replicas are then replaced by
   their average (parameter aggregation, as the paper prefers to gradient aggregation: it also
   reconciles the drift of the local steps before it), else the step stays local. With
   ``outer="nesterov"`` the average is taken as DiLoCo's pseudo-gradient instead, and the
   replicas restart from DiLoCo's outer Nesterov step on it (``outer.py``).

Bytes per rank: 8 per step for the signal, plus the model (``4 N`` in fp32, or the
compressor's message) on each synchronising step.

Design notes: ``docs/local-sgd.md``, "SelSync's signal and its budget".
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
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

    threshold: float = 0.3
    """delta: the smoothed relative change of the smoothed gradient norm that makes a step
    synchronise (0: every step)."""
    smoothing_steps: int = 25
    """w: the window of both moving averages, the norm's and its change's; the steps before
    the w-th synchronise (1: no smoothing, the raw change of the norm, no first window)."""
    smoothing_decay: float = 0.01
    """a: the k-th newest value of a window weighs (1 - a)^k (0: a plain mean)."""
    min_period_steps: int = 1
    """No synchronisation sooner than this many steps after the last one (1: any step)."""
    max_period_steps: int = 0
    """A synchronisation at the latest this many steps after the last one (0: none forced)."""
    window_steps: int = 0
    """W: one synchronisation per window of W steps, at its first step whose signal reaches
    ``threshold``, else at its last (DiLoCo's bytes at period W); 0: no windows."""
    total_steps: int = 0
    """The run's length in steps, whose window fires on no signal (``window_steps``); 0: the
    training run's own (``for_run``), or, outside one, every window synchronises."""

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.smoothing_steps < 1:
            raise ValueError(f"smoothing_steps must be >= 1, got {self.smoothing_steps}")
        if not 0 <= self.smoothing_decay < 1:
            raise ValueError(f"smoothing_decay must be in [0, 1), got {self.smoothing_decay}")
        if self.min_period_steps < 1:
            raise ValueError(f"min_period_steps must be >= 1, got {self.min_period_steps}")
        if self.max_period_steps and self.max_period_steps < self.min_period_steps:
            raise ValueError(
                f"max_period_steps ({self.max_period_steps}) must be 0 (none) or >= "
                f"min_period_steps ({self.min_period_steps})"
            )
        if self.window_steps < 0 or self.total_steps < 0:
            raise ValueError(
                f"window_steps and total_steps must be >= 0, got {self.window_steps} and "
                f"{self.total_steps}"
            )
        if self.window_steps and self.max_period_steps:
            raise ValueError(
                f"window_steps ({self.window_steps}) already bounds the gap between "
                f"synchronisations: max_period_steps must be 0, got {self.max_period_steps}"
            )
        self.periodic()  # the shared settings' own checks

    def for_run(self, run_steps: int) -> SelSyncConfig:
        """With windows and ``total_steps`` 0, the run's length."""
        if not self.window_steps or self.total_steps or run_steps < 1:
            return self
        return dataclasses.replace(self, total_steps=run_steps)


#: Fixed-point scale of the agreed signal: an integer allreduce is exact on every backend, so
#: every rank compares the same number with the threshold.
SIGNAL_SCALE = 1 << 20
#: The largest level agreed (a non-finite or huge change is capped here).
_MAX_SIGNAL_LEVEL = 1 << 62


def _signal_level(change: float) -> int:
    """``change`` in fixed point (floor, capped at ``_MAX_SIGNAL_LEVEL``)."""
    if not change < _MAX_SIGNAL_LEVEL / SIGNAL_SCALE:  # also inf and nan
        return _MAX_SIGNAL_LEVEL
    return int(change * SIGNAL_SCALE)


def _recent_mean(values: Sequence[float], decay: float) -> float:
    """The paper's weighted moving average of ``values`` (oldest first): the k-th newest
    weighs ``(1 - decay)^k``; 0 for no values."""
    if not values:
        return 0.0
    weights = [(1.0 - decay) ** k for k in range(len(values), 0, -1)]
    return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)


class GradientChangeSignal:
    """SelSync's signal on one rank (steps 1 and 2 of the module docstring): feed it each
    step's gradient norm, it returns the smoothed relative change of the smoothed norm."""

    def __init__(self, window_steps: int, decay: float) -> None:
        self.decay = decay
        self.norms: deque[float] = deque(maxlen=window_steps)
        """The last w gradient norms, oldest first."""
        self.changes: deque[float] = deque(maxlen=window_steps)
        """The last w relative changes of the smoothed norm, oldest first."""
        self.smoothed_norm: float | None = None
        """The last smoothed norm (None before the first step)."""

    def update(self, norm: float) -> float:
        """Take this step's gradient norm; return the signal (0 on the first step)."""
        self.norms.append(norm)
        previous = self.smoothed_norm
        self.smoothed_norm = _recent_mean(self.norms, self.decay)
        if previous is not None:
            # A zero norm before (no gradient at all) has no relative change to speak of.
            change = abs(self.smoothed_norm - previous) / previous if previous else 0.0
            self.changes.append(change)
        return _recent_mean(self.changes, self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {
            "norms": list(self.norms),
            "changes": list(self.changes),
            "smoothed_norm": self.smoothed_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms.clear()
        self.norms.extend(float(x) for x in state["norms"])
        self.changes.clear()
        self.changes.extend(float(x) for x in state["changes"])
        self.smoothed_norm = state["smoothed_norm"]


class SelSyncOptimizer(SyncMethodOptimizer[SelSyncConfig]):
    """SelSync's optimizer (see the module docstring); ``syncs`` lists the steps that
    synchronised, ``signals`` the agreed signal of every step, ``control_bytes`` what agreeing
    on it cost."""

    def _start(self) -> None:
        method = self.method
        self.signal = GradientChangeSignal(method.smoothing_steps, method.smoothing_decay)
        """This rank's own signal (differs between ranks)."""
        self.signals: list[float] = []
        """Per step, the agreed signal: the largest relative change any rank saw (the same on
        every rank)."""
        self.last_sync_step = 0
        """The step of the last synchronisation (0: none yet)."""
        self._threshold_level = math.ceil(self.method.threshold * SIGNAL_SCALE)

    def relative_change(self) -> float:
        """Feed this step's gradient norm to this rank's signal and return the signal."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        return self.signal.update(norm)

    def _step(self) -> None:
        """Agree on the signal (one integer allreduce), take the inner step, average when the
        signal and the period bounds say so."""
        level = agree(
            self.outer_comm, _signal_level(self.relative_change()), "max", like=self.params[0]
        )
        if self.outer_comm.world_size > 1:
            self.control_bytes += AGREE_BYTES
        self.signals.append(level / SIGNAL_SCALE)
        self._inner_step(self.config.inner_lr_scale)
        self.step_count += 1
        if self._synchronises(level):
            self.last_sync_step = self.step_count
            self._start_exchange(0, background=False)
            self._apply_arrived()

    def _synchronises(self, level: int) -> bool:
        """Whether the step just taken synchronises, from the agreed signal ``level`` and the
        steps alone (the same on every rank)."""
        method, step = self.method, self.step_count
        gap = step - self.last_sync_step
        # Before the w-th step the averages have no history: the paper synchronises.
        signalled = level >= self._threshold_level or step < method.smoothing_steps
        fired = signalled and gap >= method.min_period_steps
        if not method.window_steps:
            return fired or bool(method.max_period_steps and gap >= method.max_period_steps)
        window_end = -(-step // method.window_steps) * method.window_steps
        if self.last_sync_step > window_end - method.window_steps:
            return False  # this window has had its synchronisation
        if method.total_steps and window_end >= method.total_steps:
            # The run's last window: a signal sync here would add one to the final average;
            # only a window that ends with the run synchronises, at its end, as DiLoCo does.
            return step == window_end
        return fired or step == window_end

    def state_dict(self) -> dict[str, Any]:
        """The shared state, and the signal's averages and the flags' bytes."""
        state = super().state_dict()
        state["selsync"] = {
            "signal": self.signal.state_dict(),
            "control_bytes": self.control_bytes,
            "signals": list(self.signals),
            "last_sync_step": self.last_sync_step,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state["selsync"]
        self.signal.load_state_dict(own["signal"])
        self.control_bytes = int(own["control_bytes"])
        self.signals = [float(x) for x in own["signals"]]
        self.last_sync_step = int(own["last_sync_step"])


SelSyncConfig.optimizer_class = SelSyncOptimizer

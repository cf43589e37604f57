"""ADPSGD: an adaptive averaging period, short early and long late, under a budget of K syncs.

Jiang and Agrawal, "Adaptive Periodic Averaging: A Practical Approach to Reducing Communication
in Distributed Learning" (arXiv 2007.06134, 2020): keep the replicas' variance at each averaging
about equal, the period inversely proportional to the rate at which they drift apart. With a
budget of ``num_syncs`` (K) synchronisations over ``total_steps`` (T, the run's length):

1. the first two periods are probes of ``first_period_steps`` (default ``T / (2K)``);
2. at each synchronisation every rank measures its drift ``d`` (the distance between its
   replica and the average, recorded in ``syncs``) and the drift rate ``r = d^2 / p`` over the
   period p just ended; from the first rate ``r_1`` (at step ``t_1``) and the current one
   ``r_k`` (at ``t_k``) it fits a power law ``r(t) ~ t^-a``,
   ``a = log(r_1 / r_k) / log(t_k / t_1)``, clipped to [0, 2];
3. the next period spends the ``n`` syncs left over the ``T - t_k`` steps left at that rate:
   ``p = t_k F / n`` with ``F = ((T / t_k)^(1 - a) - 1) / (1 - a)`` (``log(T / t_k)`` at
   a = 1); ``n = K - k``, plus one with ``final_sync`` (the average at the end closes the last
   period);
4. one integer allreduce (min) makes the most drifting replica's proposal everyone's period;
5. after K synchronisations none follows (``finish()`` averages once more at the end).

Bytes per rank: the model (``4 N`` in fp32, or the compressor's message) per synchronisation,
plus 8 for the agreement on the next period.

Design notes: ``docs/local-sgd.md``, "ADPSGD: the principle, the outer step and the probes".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from commfuse.localsgd.sync_method import (
    AGREE_BYTES,
    ExchangeSettingsWithOuterStep,
    SyncMethodOptimizer,
    agree,
)

#: The decay exponent ``a`` is clipped to [0, _MAX_DECAY].
_MAX_DECAY = 2.0


@dataclass(frozen=True, kw_only=True)
class ADPSGDConfig(ExchangeSettingsWithOuterStep):
    """ADPSGD (Jiang and Agrawal 2020): ``num_syncs`` averages over ``total_steps``, their
    periods set from the measured drift between replicas."""

    name = "adpsgd"

    total_steps: int = 0
    """T: the run's length in steps (the budget is spread over it); 0: the training run's own
    (``commfuse train``'s ``--steps``, less an ``--init-from`` model's)."""
    num_syncs: int = 10
    """K: synchronisations planned over ``total_steps``, the final average (``final_sync``)
    apart."""
    first_period_steps: int = 0
    """Length of the two probe periods that measure the first drift rates (0: T / (2K))."""

    def __post_init__(self) -> None:
        if self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0 (0: the run's), got {self.total_steps}")
        if self.num_syncs < 1 or (self.total_steps and self.num_syncs > self.total_steps):
            raise ValueError(
                f"num_syncs must be in [1, total_steps={self.total_steps}], got {self.num_syncs}"
            )
        if self.first_period_steps < 0:
            raise ValueError(f"first_period_steps must be >= 0, got {self.first_period_steps}")
        self.periodic()  # the shared settings' own checks

    @property
    def probe_steps(self) -> int:
        """The probe periods' length."""
        return self.first_period_steps or max(1, self.total_steps // (2 * self.num_syncs))

    def for_run(self, run_steps: int) -> ADPSGDConfig:
        """With ``total_steps`` 0, the run's length."""
        if self.total_steps or run_steps < 1:
            return self
        return dataclasses.replace(self, total_steps=run_steps)

    def check_ready(self) -> None:
        """The plan needs the run's length.

        Raises:
            ValueError: ``total_steps`` is 0 (a training run fills it in: ``for_run``).
        """
        if not self.total_steps:
            raise ValueError("ADPSGD needs total_steps, the run's length in steps, to plan K syncs")


def next_period(
    *, t_k: int, rate_k: float, t_1: int, rate_1: float, syncs_left: int, total_steps: int
) -> int:
    """Step 3 of the module docstring: the period after the sync at step ``t_k`` (>= 1)."""
    steps_left = total_steps - t_k
    if steps_left <= 0 or syncs_left <= 0:
        return max(1, steps_left)
    decay = 0.0
    if t_k > t_1 and rate_k > 0 and rate_1 > 0:
        decay = min(_MAX_DECAY, max(0.0, math.log(rate_1 / rate_k) / math.log(t_k / t_1)))
    ratio = total_steps / t_k
    spread = math.log(ratio) if abs(1 - decay) < 1e-9 else (ratio ** (1 - decay) - 1) / (1 - decay)
    return min(steps_left, max(1, round(t_k * spread / syncs_left)))


class ADPSGDOptimizer(SyncMethodOptimizer[ADPSGDConfig]):
    """ADPSGD's optimizer (the module docstring); ``sync_steps`` lists the steps that averaged
    (the same on every rank), ``control_bytes`` what agreeing on the periods cost."""

    def _start(self) -> None:
        self.next_sync_at = self.method.probe_steps
        """The step after which the next synchronisation happens (0: none left)."""
        self.sync_steps: list[int] = []
        self.first_rate: tuple[int, float] | None = None
        """(t_1, r_1): this rank's first measured drift rate."""

    def _step(self) -> None:
        """The inner step, then the synchronisation when one is due and the next period."""
        self._inner_step(self.config.inner_lr_scale)
        self.step_count += 1
        if self.step_count != self.next_sync_at:
            return
        last = self.sync_steps[-1] if self.sync_steps else 0
        self._start_exchange(0, background=False)
        self._apply_arrived()
        self.sync_steps.append(self.step_count)
        self.next_sync_at = self._plan(self.syncs[-1].drift, self.step_count - last)

    def _plan(self, drift: float, period: int) -> int:
        """Steps 2-5 of the module docstring: the step of the next synchronisation (0: none)."""
        done, method = len(self.sync_steps), self.method
        if done >= method.num_syncs or self.step_count >= method.total_steps:
            return 0  # the same on every rank: no agreement needed
        rate = drift * drift / period
        if self.first_rate is None:
            self.first_rate = (self.step_count, rate)
        if done < 2:
            proposal = method.probe_steps
        else:
            t_1, rate_1 = self.first_rate
            proposal = next_period(
                t_k=self.step_count,
                rate_k=rate,
                t_1=t_1,
                rate_1=rate_1,
                syncs_left=method.num_syncs - done + int(method.final_sync),
                total_steps=method.total_steps,
            )
        agreed = agree(self.outer_comm, proposal, "min", like=self.params[0])
        if self.outer_comm.world_size > 1:
            self.control_bytes += AGREE_BYTES
        return self.step_count + agreed

    def state_dict(self) -> dict[str, Any]:
        """The shared state, and the schedule so far."""
        state = super().state_dict()
        state["adpsgd"] = {
            "next_sync_at": self.next_sync_at,
            "sync_steps": list(self.sync_steps),
            "first_rate": None if self.first_rate is None else list(self.first_rate),
            "control_bytes": self.control_bytes,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state["adpsgd"]
        self.next_sync_at = int(own["next_sync_at"])
        self.sync_steps = [int(s) for s in own["sync_steps"]]
        first = own["first_rate"]
        self.first_rate = None if first is None else (int(first[0]), float(first[1]))
        self.control_bytes = int(own["control_bytes"])


ADPSGDConfig.optimizer_class = ADPSGDOptimizer

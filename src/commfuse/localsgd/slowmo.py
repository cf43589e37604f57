"""SlowMo: local SGD with a slow outer momentum.

Wang, Tantia, Ballas and Rabbat, "SlowMo: Improving communication-efficient distributed SGD with
slow momentum" (ICLR 2020). Every H inner steps:

1. the replicas average their pseudo-gradient ``delta = anchor - params``;
2. the slow momentum ``m = beta m + delta_avg`` is updated;
3. the anchor moves ``anchor -= alpha m``, and every replica restarts from it.

``beta = 0`` and ``alpha = 1`` is local SGD. The paper's settings: beta in 0.4-0.8 with alpha 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSettings, PeriodicSyncConfig, SyncOptions


@dataclass(frozen=True, kw_only=True)
class SlowMoConfig(PeriodicSettings):
    """SlowMo (Wang et al. 2020): local SGD with a slow outer momentum (the paper's names)."""

    name = "slowmo"

    H: int = 8
    """Inner steps between two synchronisations."""
    beta: float = 0.5
    """Slow momentum (``PeriodicSyncConfig.outer_momentum``)."""
    alpha: float = 1.0
    """Slow learning rate (``PeriodicSyncConfig.outer_lr``)."""

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: the outer SGD of momentum beta and rate alpha."""
        return PeriodicSyncConfig(
            H=self.H, outer_momentum=self.beta, outer_lr=self.alpha, **self.shared()
        )


def slowmo(
    *, H: int = 8, beta: float = 0.5, alpha: float = 1.0, **shared: Unpack[SyncOptions]
) -> SlowMoConfig:
    """SlowMo with period ``H``, slow momentum ``beta`` and slow learning rate ``alpha`` (the
    paper's names; ``outer_momentum`` and ``outer_lr`` of the shared machinery's config);
    ``shared`` as for ``local_sgd``.

    Example::

        config = slowmo(H=8, beta=0.5)
    """
    return SlowMoConfig(H=H, beta=beta, alpha=alpha, **shared)

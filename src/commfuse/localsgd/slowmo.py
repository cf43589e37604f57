"""SlowMo: local SGD with a slow outer momentum.

Wang, Tantia, Ballas and Rabbat, "SlowMo: Improving communication-efficient distributed SGD with
slow momentum" (ICLR 2020). Every H inner steps:

1. the replicas average their pseudo-gradient ``delta = anchor - params``;
2. the slow momentum ``m = beta m + delta_avg`` is updated;
3. the anchor moves ``anchor -= alpha m``, and every replica restarts from it.

``beta = 0`` and ``alpha = 1`` is local SGD. The paper's settings: beta in 0.4-0.8 with alpha 1.
"""

from __future__ import annotations

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions


def slowmo(
    *, H: int = 8, beta: float = 0.5, alpha: float = 1.0, **shared: Unpack[SyncOptions]
) -> PeriodicSyncConfig:
    """SlowMo with period ``H``, slow momentum ``beta`` and slow learning rate ``alpha`` (the
    paper's names; ``outer_momentum`` and ``outer_lr`` of the config); ``shared`` as for
    ``local_sgd``.

    Example::

        config = slowmo(H=8, beta=0.5)
    """
    return PeriodicSyncConfig(period_steps=H, outer_momentum=beta, outer_lr=alpha, **shared)

"""DiLoCo: distributed low-communication training.

Douillard et al., "DiLoCo: Distributed low-communication training of language models" (2023).
Every replica runs H steps of its inner optimizer (AdamW in the paper); then:

1. the replicas average their pseudo-gradient ``delta = anchor - params``;
2. an outer SGD step with Nesterov momentum (0.9) and learning rate 0.7 moves the anchor;
3. every replica restarts from the new anchor.

With H = 500 the paper matches synchronous training while communicating 500 times less. Start
from a model trained synchronously for a while, as the paper does (``commfuse train
--init-from``), and tune ``inner_lr_scale`` below 1 when the replicas' batches are small.
"""

from __future__ import annotations

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM


def diloco(
    *,
    H: int = 50,
    outer_lr: float = DILOCO_OUTER_LR,
    outer_momentum: float = DILOCO_OUTER_MOMENTUM,
    nesterov: bool = True,
    **shared: Unpack[SyncOptions],
) -> PeriodicSyncConfig:
    """DiLoCo with period ``H`` and the outer Nesterov SGD of ``outer_lr`` and
    ``outer_momentum``; ``shared`` as for ``local_sgd``.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = PeriodicSyncOptimizer(inner, model, comm, diloco(H=50, outer_lr=0.7))
    """
    return PeriodicSyncConfig(
        period_steps=H,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        **shared,
    )

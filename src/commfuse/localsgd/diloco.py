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

from commfuse.compress.base import Compressor
from commfuse.localsgd.config import PeriodicSyncConfig


def diloco(
    *,
    H: int = 50,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    compressor: Compressor | None = None,
    algo: str = "auto",
    hierarchical: bool = False,
    ranks_per_host: int = 1,
    inner_lr_scale: float = 1.0,
    final_sync: bool = True,
) -> PeriodicSyncConfig:
    """DiLoCo with period ``H`` and the outer Nesterov SGD of ``outer_lr`` and
    ``outer_momentum``. The other arguments are ``local_sgd``'s.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = PeriodicSyncOptimizer(inner, model, comm, diloco(H=50, outer_lr=0.7))
    """
    return PeriodicSyncConfig(
        period_steps=H,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        compressor=compressor,
        algo=algo,
        hierarchical=hierarchical,
        ranks_per_host=ranks_per_host,
        inner_lr_scale=inner_lr_scale,
        final_sync=final_sync,
    )

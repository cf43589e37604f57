"""DiLoCo: distributed low-communication training.

Douillard et al., "DiLoCo: Distributed low-communication training of language models" (2023).
Every replica runs H steps of its inner optimizer (AdamW in the paper); then:

1. the replicas average their pseudo-gradient ``delta = anchor - params``;
2. an outer SGD step with Nesterov momentum (0.9) and learning rate 0.7 moves the anchor;
3. every replica restarts from the new anchor.

With H = 500 the paper matches synchronous training while communicating 500 times less. Start
from a model trained synchronously for a while, as the paper does (``commfuse train
--init-from``), and set ``inner_lr_scale`` below 1 there (0.35 on charlm): replicas that
continue a synchronous run's AdamW state at its full rate on 1/P of its batch first see their
loss rise (docs/local-sgd.md). A compressor whose paper pairs it with its own outer step
(``Compressor.outer_recipe``: SparseLoCo's plain average) gets that step for each outer
setting left unset, with a warning that says so.
"""

from __future__ import annotations

import warnings

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM


def diloco(
    *,
    H: int = 50,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    nesterov: bool = True,
    **shared: Unpack[SyncOptions],
) -> PeriodicSyncConfig:
    """DiLoCo with period ``H`` and the outer Nesterov SGD of ``outer_lr`` and
    ``outer_momentum``; ``shared`` as for ``local_sgd``.

    ``outer_lr`` and ``outer_momentum`` left None take the compressor's ``outer_recipe`` where
    it has one (``SparseLoCo()``: lr 1.0, momentum 0, its paper's plain average, since its
    decayed residual already is a momentum), else DiLoCo's 0.7 and 0.9. Set either to keep it.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = PeriodicSyncOptimizer(inner, model, comm, diloco(H=50, outer_lr=0.7))
    """
    compressor = shared.get("compressor")
    recipe = None if compressor is None else compressor.outer_recipe
    if compressor is not None and recipe is not None and None in (outer_lr, outer_momentum):
        applied = {
            key: value
            for key, value, given in (
                ("outer_lr", recipe.lr, outer_lr),
                ("outer_momentum", recipe.momentum, outer_momentum),
            )
            if given is None
        }
        warnings.warn(
            f"diloco: the {compressor.name} compressor's paper steps by its own outer SGD; "
            f"applied {', '.join(f'{k}={v:g}' for k, v in applied.items())} (set "
            f"{' and '.join(applied)} to choose; DiLoCo's are outer_lr="
            f"{DILOCO_OUTER_LR:g}, outer_momentum={DILOCO_OUTER_MOMENTUM:g})",
            stacklevel=2,
        )
    if outer_lr is None:
        outer_lr = DILOCO_OUTER_LR if recipe is None else recipe.lr
    if outer_momentum is None:
        outer_momentum = DILOCO_OUTER_MOMENTUM if recipe is None else recipe.momentum
    return PeriodicSyncConfig(
        period_steps=H,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        **shared,
    )

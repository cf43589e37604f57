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
from dataclasses import dataclass

from typing_extensions import Unpack

from commfuse.compress.base import Compressor
from commfuse.localsgd.config import PeriodicSettings, PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig(PeriodicSettings):
    """DiLoCo (Douillard et al. 2023): H inner steps, then the outer Nesterov SGD on the
    averaged pseudo-gradient."""

    name = "diloco"

    H: int = 50
    """Inner steps between two synchronisations."""
    outer_lr: float | None = None
    """Outer learning rate; None: the compressor's ``outer_recipe`` where it has one, else
    DiLoCo's 0.7."""
    outer_momentum: float | None = None
    """Outer (Nesterov) momentum; None: the compressor's ``outer_recipe`` where it has one,
    else DiLoCo's 0.9."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD."""

    def __post_init__(self) -> None:
        warn_outer_recipe(self.compressor, self.outer_lr, self.outer_momentum)
        super().__post_init__()

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: the outer step with every setting resolved."""
        outer_lr, outer_momentum = outer_step(self.compressor, self.outer_lr, self.outer_momentum)
        return PeriodicSyncConfig(
            H=self.H,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=self.nesterov,
            **self.shared(),
        )


def outer_step(
    compressor: Compressor | None, outer_lr: float | None, outer_momentum: float | None
) -> tuple[float, float]:
    """DiLoCo's outer learning rate and momentum: each one given, else the compressor's
    ``outer_recipe`` where it has one, else DiLoCo's (0.7, 0.9)."""
    recipe = None if compressor is None else compressor.outer_recipe
    if outer_lr is None:
        outer_lr = DILOCO_OUTER_LR if recipe is None else recipe.lr
    if outer_momentum is None:
        outer_momentum = DILOCO_OUTER_MOMENTUM if recipe is None else recipe.momentum
    return outer_lr, outer_momentum


def warn_outer_recipe(
    compressor: Compressor | None, outer_lr: float | None, outer_momentum: float | None
) -> None:
    """Warn that a compressor's paper's outer step (its ``outer_recipe``) replaces DiLoCo's
    for each outer setting left unset, naming what it applies."""
    recipe = None if compressor is None else compressor.outer_recipe
    if compressor is None or recipe is None or None not in (outer_lr, outer_momentum):
        return
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
        stacklevel=4,
    )


def diloco(
    *,
    H: int = 50,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    nesterov: bool = True,
    **shared: Unpack[SyncOptions],
) -> DiLoCoConfig:
    """DiLoCo with period ``H`` and the outer Nesterov SGD of ``outer_lr`` and
    ``outer_momentum``; ``shared`` as for ``local_sgd``.

    ``outer_lr`` and ``outer_momentum`` left None take the compressor's ``outer_recipe`` where
    it has one (``SparseLoCo()``: lr 1.0, momentum 0, its paper's plain average, since its
    decayed residual already is a momentum), else DiLoCo's 0.7 and 0.9. Set either to keep it.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = PeriodicSyncOptimizer(inner, model, comm, diloco(H=50, outer_lr=0.7))
    """
    return DiLoCoConfig(
        H=H, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, **shared
    )

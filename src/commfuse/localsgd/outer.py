"""The outer step: SGD (optionally with momentum, Nesterov) on the averaged pseudo-gradient.

Every method here keeps an *anchor*, the parameters as of the last synchronisation. After H
inner steps each replica's pseudo-gradient is ``delta = anchor - params`` (how far it moved);
the replicas average it, and the outer optimizer treats the average as a gradient:

1. ``m = mu m + delta_avg`` (no momentum: ``m = delta_avg``);
2. ``update = delta_avg + mu m`` with Nesterov, else ``update = m``;
3. ``anchor = anchor - outer_lr update``; the parameters restart from the new anchor.

With ``outer_lr = 1`` and no momentum, ``anchor - delta_avg`` is the plain average of the
replicas: local SGD (Stich 2019). SlowMo (Wang et al. 2020) is the same with momentum beta and
outer lr alpha; DiLoCo (Douillard et al. 2023) uses Nesterov momentum 0.9 and outer lr 0.7,
exactly as ``torch.optim.SGD(nesterov=True)`` would on the pseudo-gradient.
"""

from __future__ import annotations

import torch

#: DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9


def outer_sgd_(
    anchor: torch.Tensor,
    delta_avg: torch.Tensor,
    momentum: torch.Tensor | None,
    *,
    lr: float,
    mu: float,
    nesterov: bool,
) -> None:
    """Apply one outer SGD step to ``anchor`` in place (and to ``momentum``, when mu > 0)."""
    if mu == 0.0 or momentum is None:
        anchor.add_(delta_avg, alpha=-lr)
        return
    momentum.mul_(mu).add_(delta_avg)
    if nesterov:
        anchor.add_(delta_avg.add(momentum, alpha=mu), alpha=-lr)
    else:
        anchor.add_(momentum, alpha=-lr)

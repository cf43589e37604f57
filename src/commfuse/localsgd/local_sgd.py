"""Local SGD and post-local SGD: average the replicas every H steps.

Stich, "Local SGD converges fast and communicates little" (ICLR 2019): every rank trains its
own replica with the inner optimizer, and every H steps the replicas are replaced by their
average, one allreduce of the parameters instead of H allreduces of gradients.

Lin et al., "Don't use large mini-batches, use local SGD" (ICLR 2020), post-local SGD: the first
``warmup_steps`` are fully synchronous data parallel (gradients averaged every step), the phase
where the loss falls fastest and replicas would drift most; local SGD takes over after them.

Tuning: H trades bytes for drift (bytes per step fall by H; the replicas' drift, reported per
synchronisation, grows with it); start around 8 and raise it while the loss keeps up.
"""

from __future__ import annotations

from commfuse.compress.base import Compressor
from commfuse.localsgd.config import PeriodicSyncConfig


def local_sgd(
    *,
    H: int = 8,
    compressor: Compressor | None = None,
    algo: str = "auto",
    hierarchical: bool = False,
    ranks_per_host: int = 1,
    inner_lr_scale: float = 1.0,
    final_sync: bool = True,
) -> PeriodicSyncConfig:
    """Local SGD: the plain average of the replicas every ``H`` inner steps.

    Args:
        H: inner steps between two averages.
        compressor: compresses each exchange (with its error feedback); None sends fp32.
        algo: commfuse allreduce algorithm of the uncompressed exchange.
        hierarchical: average gradients inside each host every step, replicas across hosts
            every H steps (needs ``ranks_per_host``).
        ranks_per_host: ranks per host, for ``hierarchical``.
        inner_lr_scale: multiplies the inner learning rate between synchronisations.
        final_sync: average every replica at ``finish()``, so all ranks end with one model.

    Returns:
        The config for ``PeriodicSyncOptimizer``.

    Example::

        opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm,
                                    local_sgd(H=8))
    """
    return PeriodicSyncConfig(
        period_steps=H,
        compressor=compressor,
        algo=algo,
        hierarchical=hierarchical,
        ranks_per_host=ranks_per_host,
        inner_lr_scale=inner_lr_scale,
        final_sync=final_sync,
    )


def post_local_sgd(
    *,
    H: int = 8,
    warmup_steps: int = 100,
    compressor: Compressor | None = None,
    algo: str = "auto",
    hierarchical: bool = False,
    ranks_per_host: int = 1,
    inner_lr_scale: float = 1.0,
    final_sync: bool = True,
) -> PeriodicSyncConfig:
    """Post-local SGD: ``warmup_steps`` of synchronous data parallel, then local SGD with
    period ``H``. The other arguments are ``local_sgd``'s.

    Example::

        config = post_local_sgd(H=8, warmup_steps=100)
    """
    return PeriodicSyncConfig(
        period_steps=H,
        warmup_steps=warmup_steps,
        compressor=compressor,
        algo=algo,
        hierarchical=hierarchical,
        ranks_per_host=ranks_per_host,
        inner_lr_scale=inner_lr_scale,
        final_sync=final_sync,
    )

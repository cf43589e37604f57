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

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions


def local_sgd(*, H: int = 8, **shared: Unpack[SyncOptions]) -> PeriodicSyncConfig:
    """Local SGD: the plain average of the replicas every ``H`` inner steps.

    Args:
        H: inner steps between two averages.
        **shared: the settings every method takes (``SyncOptions``: ``compressor``, ``algo``,
            ``hierarchical``, ``ranks_per_host``, ``inner_lr_scale``, ``final_sync``).

    Returns:
        The config for ``PeriodicSyncOptimizer``.

    Example::

        opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm,
                                    local_sgd(H=8))
    """
    return PeriodicSyncConfig(period_steps=H, **shared)


def post_local_sgd(
    *, H: int = 8, warmup_steps: int = 100, **shared: Unpack[SyncOptions]
) -> PeriodicSyncConfig:
    """Post-local SGD: ``warmup_steps`` of synchronous data parallel, then local SGD with
    period ``H``; ``shared`` as for ``local_sgd``.

    Example::

        config = post_local_sgd(H=8, warmup_steps=100)
    """
    return PeriodicSyncConfig(period_steps=H, warmup_steps=warmup_steps, **shared)

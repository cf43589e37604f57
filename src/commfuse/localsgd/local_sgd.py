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

from dataclasses import dataclass

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSettings, PeriodicSyncConfig, SyncOptions


@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig(PeriodicSettings):
    """Local SGD (Stich 2019): the plain average of the replicas every H inner steps."""

    name = "local-sgd"

    H: int = 8
    """Inner steps between two averages."""

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: plain averaging every H steps."""
        return PeriodicSyncConfig(H=self.H, **self.shared())


@dataclass(frozen=True, kw_only=True)
class PostLocalSGDConfig(PeriodicSettings):
    """Post-local SGD (Lin et al. 2020): synchronous for ``warmup_steps``, then local SGD."""

    name = "post-local-sgd"

    H: int = 8
    """Inner steps between two averages, after the warm-up."""
    warmup_steps: int = 100
    """Steps of synchronous data parallel (gradients averaged every step) first."""

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: the warm-up, then averaging every H steps."""
        return PeriodicSyncConfig(H=self.H, warmup_steps=self.warmup_steps, **self.shared())


def local_sgd(*, H: int = 8, **shared: Unpack[SyncOptions]) -> LocalSGDConfig:
    """Local SGD: the plain average of the replicas every ``H`` inner steps.

    Args:
        H: inner steps between two averages.
        **shared: the settings every method takes (``SyncOptions``: ``compressor``, ``algo``,
            ``hierarchical``, ``ranks_per_host``, ``inner_lr_scale``, ``final_sync``).

    Returns:
        The method's config, for ``PeriodicSyncOptimizer`` or a training run.

    Raises:
        ValueError: a setting out of its range (``H`` below 1, ...).

    Example::

        opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm,
                                    local_sgd(H=8))
    """
    return LocalSGDConfig(H=H, **shared)


def post_local_sgd(
    *, H: int = 8, warmup_steps: int = 100, **shared: Unpack[SyncOptions]
) -> PostLocalSGDConfig:
    """Post-local SGD: ``warmup_steps`` of synchronous data parallel, then local SGD with
    period ``H``; ``shared`` as for ``local_sgd``.

    Example::

        config = post_local_sgd(H=8, warmup_steps=100)
    """
    return PostLocalSGDConfig(H=H, warmup_steps=warmup_steps, **shared)

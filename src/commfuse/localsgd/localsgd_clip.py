"""Local SGD with gradient clipping: clipped local steps, the replicas averaged every I steps.

Liu, Zhuang, Lei and Liao, "A Communication-Efficient Distributed Gradient Clipping Algorithm
for Training Deep Neural Networks" (NeurIPS 2022). Language models and other networks whose
loss is not L-smooth (the smoothness grows with the gradient norm) need clipping; the paper
shows that clipping each replica's *local* steps keeps local SGD's saving of communication:

1. each rank computes its gradient ``g`` on its own batch;
2. it clips it, ``g <- min(1, max_norm / |g|) g`` (torch's ``clip_grad_norm_``), and takes its
   inner step: with SGD of learning rate eta this is the paper's
   ``x <- x - min(eta, gamma / |g|) g`` with ``gamma = eta max_norm``;
3. every I steps the replicas are replaced by their average.

I = 1 is synchronous training with per-replica clipping (the average of the replicas' clipped
steps); the paper's speed-up over naive parallel clipping grows with I while the loss keeps up.
Tune ``max_norm`` as for single-process clipping (the norm of a typical gradient, or below it
where the loss spikes), then raise I as for local SGD.

Bytes per rank: the model (``4 N`` in fp32) every I steps, ``4 N / I`` per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from commfuse.localsgd.config import PeriodicSyncConfig
from commfuse.localsgd.sync_method import ExchangeSettings, SyncMethodOptimizer


@dataclass(frozen=True, kw_only=True)
class LocalSGDClipConfig(ExchangeSettings):
    """Local SGD with clipped local steps (Liu et al., NeurIPS 2022)."""

    name = "localsgd-clip"

    H: int = 8
    """I: inner steps between two averages."""
    max_norm: float = 1.0
    """Each local gradient is scaled down to at most this L2 norm (over all parameters)."""

    def __post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {self.max_norm}")
        self.periodic()  # the shared settings' own checks (H >= 1, ...)

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: local SGD with period I."""
        return dataclasses.replace(super().periodic(), H=self.H)


class LocalSGDClipOptimizer(SyncMethodOptimizer[LocalSGDClipConfig]):
    """Local SGD whose every inner step is on the clipped gradient (the module docstring); the
    paper's inner optimizer is SGD."""

    def _inner_step(self, lr_scale: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.method.max_norm)
        super()._inner_step(lr_scale)


LocalSGDClipConfig.optimizer_class = LocalSGDClipOptimizer

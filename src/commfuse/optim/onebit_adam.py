"""1-bit Adam: Adam's convergence with 1-bit communication after a warm-up.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed" (ICML 2021). Adam's variance is
non-linear in the gradient, so error-compensated compression, which works for SGD's momentum,
breaks it; but the variance settles early in training. So:

1. warm-up (the first ``freeze_step`` steps): plain Adam(W) on gradients averaged in full
   precision (one allreduce per step);
2. then the variance ``v`` is frozen and Adam is a momentum SGD preconditioned by a fixed
   ``1 / sqrt(v)``: every rank updates the momentum with its OWN gradient,
   ``m = beta1 m + (1 - beta1) g``, and the ranks average ``m`` by the two-phase 1-bit
   allreduce with error feedback (``compressed_all_reduce.py``): about ``2 n / 8`` bytes per
   rank and step instead of a gradient allreduce's ``2 n x 4``;
3. every rank decodes the same average, so parameters and moments stay identical across ranks.

With ``exchange="none"`` the momentum is averaged in fp32, which is Adam with its variance
frozen at ``freeze_step`` (the reference the 1-bit exchange approximates). DeepSpeed's
implementation is GPU-only (NCCL, MPI) and its checkpoints drop the residuals; this one runs
on any backend and its ``state_dict`` carries them, so a resume continues bit for bit.

Tuning: ``freeze_step`` about 15-25% of training (the paper's BERT runs: 16K of 118K steps); too
early and the frozen variance misjudges later gradients, too late and the savings shrink.
"""

from __future__ import annotations

import torch

from commfuse.optim.compressed_adam import CompressedAdam
from commfuse.optim.config import OneBitAdamConfig


class OneBitAdam(CompressedAdam[OneBitAdamConfig]):
    """1-bit Adam (module docstring) over ``params``.

    Args:
        params: the parameters, as for ``torch.optim.AdamW``.
        comm: the data-parallel group.
        config: ``OneBitAdamConfig`` (freeze step, exchange, algorithms).
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay.

    Example::

        opt = OneBitAdam(model.parameters(), comm, OneBitAdamConfig(freeze_step=100), lr=1e-3)
        for batch in data:
            loss_fn(model, batch).backward()   # no DDP: the optimizer communicates
            opt.step()
            opt.zero_grad()
    """

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compressed phase."""
        return self.step_count >= self.config.freeze_step

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One step: Adam on averaged gradients during the warm-up, then the 1-bit momentum
        step with the variance frozen."""
        if closure is not None:
            raise ValueError("OneBitAdam.step takes no closure")
        compressing = self.compressing
        self.step_count += 1
        if compressing:
            self.onebit_momentum_step_(self.gradients())
        else:
            self.adam_step_(self.average_gradients())

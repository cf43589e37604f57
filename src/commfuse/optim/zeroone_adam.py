"""0/1 Adam: 1-bit Adam with adaptive variance freezing and local steps.

Lu, Li, Zhang, De Sa and He, "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam" (ICLR 2023). 1-bit Adam still runs full-precision Adam for its whole warm-up, and
still communicates every step. 0/1 Adam removes both:

1. adaptive variance freezing: up to ``var_freeze_step`` the variance is updated only at the
   steps of ``variance_steps`` (``var_update_scaler`` steps one apart, as many two apart,
   four apart, ...), with gradients averaged in full precision; between them it stays frozen
   and the momentum is averaged in 1 bit, as in 1-bit Adam;
2. after ``var_freeze_step`` the variance never changes, and ranks take local steps: each
   updates its momentum with its own gradient and its replica with its own momentum, and
   accumulates ``u += lr_t m_t`` (``lr_t`` with Adam's momentum correction);
3. at the steps of ``sync_steps`` (intervals doubling every ``local_step_scaler``
   synchronisations, at most ``local_step_clipper``), the ranks average ``u`` by the 1-bit
   allreduce with error feedback (``compressed_all_reduce.py``); every replica restarts from
   the last synchronised parameters minus ``avg(u) / (sqrt(v) + eps)``, and the momentum
   becomes ``avg(u) / sum lr_t``. Steps in between send nothing at all (the rounds skipped).

With a synchronisation at every step (``local_step_clipper=1``) the local phase is 1-bit
Adam's compressed phase again (up to where the learning rate multiplies). Decoupled weight
decay applies to the replica and to the synchronised parameters alike. This implementation
runs on any backend and its ``state_dict`` carries the residuals, the synchronised parameters
and the accumulated update, so a resume continues bit for bit.

Tuning: DeepSpeed's BERT settings are ``var_freeze_step=100000``, ``var_update_scaler=16``,
``local_step_scaler=32678``, ``local_step_clipper=16``; a short run wants all four smaller.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.optim.compressed_adam import CompressedAdam
from commfuse.optim.config import ZeroOneAdamConfig, sync_steps, variance_steps


class ZeroOneAdam(CompressedAdam[ZeroOneAdamConfig]):
    """0/1 Adam (module docstring) over ``params``.

    Args:
        params: the parameters, as for ``torch.optim.AdamW``.
        comm: the data-parallel group.
        config: ``ZeroOneAdamConfig`` (the two policies, exchange, algorithms).
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay.

    Example::

        opt = ZeroOneAdam(model.parameters(), comm, ZeroOneAdamConfig(var_freeze_step=50))
    """

    def _start(self) -> None:
        self._variance_steps = set(variance_steps(self.config))
        self._sync_steps: set[int] = set()
        self._sync_known_to = self.config.var_freeze_step
        self.anchors: list[torch.Tensor] | None = None
        """The parameters as of the last synchronisation (the local phase only)."""
        self.accumulated: list[torch.Tensor] | None = None
        """``u``: the sum of ``lr_t m_t`` since the last synchronisation."""
        self.lr_sums: list[float] = [0.0] * len(self.param_groups)
        """Per group, the sum of ``lr_t`` since the last synchronisation."""

    def is_sync_step(self, step: int) -> bool:
        """Whether the local phase synchronises after ``step`` (1-based)."""
        if step > self._sync_known_to:
            last = max(step, 2 * self._sync_known_to)
            self._sync_steps = set(sync_steps(self.config, last))
            self._sync_known_to = last
        return step in self._sync_steps

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One step of the phase this step is in (module docstring)."""
        if closure is not None:
            raise ValueError("ZeroOneAdam.step takes no closure")
        self.step_count += 1
        t = self.step_count
        if t <= self.config.var_freeze_step:
            if t in self._variance_steps:
                self.adam_step_(self.average_gradients())
            else:
                self.onebit_momentum_step_(self.gradients())
            return
        self._local_step(self.gradients())
        if self.is_sync_step(t):
            self._synchronise()

    @torch.no_grad()
    def finish(self) -> None:
        """End of training: synchronise the local steps taken since the last synchronisation
        (if any), so that every rank ends with the same model. Calling it again changes
        nothing."""
        if self.accumulated is not None and any(self.lr_sums):
            self._synchronise()

    def _local_step(self, grads: list[torch.Tensor]) -> None:
        params = self.params()
        if self.anchors is None or self.accumulated is None:
            self.anchors = [p.detach().clone() for p in params]
            self.accumulated = [torch.zeros_like(p) for p in params]
        index = 0
        for g, group in enumerate(self.param_groups):
            size = self.step_size(group)
            decay = 1 - group["lr"] * group["weight_decay"]
            self.lr_sums[g] += size
            for p in group["params"]:
                m, v = self.moments(p)
                self.update_momentum_(m, grads[index], group["betas"][0])
                self.mask_unseen_(m, v)
                self.accumulated[index].add_(m, alpha=size)
                self.anchors[index].mul_(decay)
                self.apply_update_(p, m, v, group)
                index += 1

    @torch.no_grad()
    def _synchronise(self) -> None:
        assert self.anchors is not None and self.accumulated is not None
        self.exchange_(self.accumulated, key="update")
        index = 0
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                m, v = self.moments(p)
                u = self.accumulated[index]
                self.mask_unseen_(u, v)
                anchor = self.anchors[index]
                anchor.addcdiv_(u, self.denominator(v, group), value=-1.0)
                p.copy_(anchor)
                m.copy_(u).div_(self.lr_sums[g])
                u.zero_()
                index += 1
            self.lr_sums[g] = 0.0

    def extra_state(self) -> dict[str, Any]:
        return {
            "anchors": None if self.anchors is None else [a.clone() for a in self.anchors],
            "accumulated": None
            if self.accumulated is None
            else [u.clone() for u in self.accumulated],
            "lr_sums": list(self.lr_sums),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        anchors, accumulated = state["anchors"], state["accumulated"]
        self.anchors = None if anchors is None else [a.clone() for a in anchors]
        self.accumulated = None if accumulated is None else [u.clone() for u in accumulated]
        self.lr_sums = [float(x) for x in state["lr_sums"]]

"""What 1-bit Adam and 0/1 Adam share: Adam(W)'s state and update, and the exchanges.

``CompressedAdam`` is a ``torch.optim.Optimizer`` whose per-parameter state is torch Adam's
(``exp_avg``, ``exp_avg_sq``), so a model trained with ``torch.optim.AdamW`` continues with
its moments. The update is torch's single-tensor AdamW, step for step:

1. ``p = p (1 - lr weight_decay)``;
2. ``p = p - lr / (1 - beta1^t) m / (sqrt(v) / sqrt(1 - beta2^k) + eps)``,

with ``t`` the step and ``k`` the number of variance updates so far (``t`` for Adam; frozen
with the variance).

Coordinates whose variance is exactly zero (no gradient in any variance update: an embedding
row never looked up, a weight of an always-zero input) keep a zero momentum wherever it is
averaged in 1 bit or taken from one rank's gradient with the variance frozen
(``mask_unseen_``): a sign carries no zero, so 1 bit would give them ``+-scale``, and divided
by ``eps`` that is a step of ``lr scale / eps``. DeepSpeed asks the user for this mask
(``exp_avg_mask``); here it is the variance's own zeros, the same on every rank. Where plain
Adam runs, a zero variance has a zero momentum anyway. Every exchange is over one flat buffer of all the parameters (one
collective per step, whatever the number of tensors): a full-precision average of the
gradients (``average_gradients``), or of the momentum or the accumulated update, 1-bit or fp32
(``exchange_``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import torch

from commfuse import collectives
from commfuse.comm import Communicator
from commfuse.optim.compressed_all_reduce import CompressedAllReduce
from commfuse.optim.config import ExchangeConfig

C = TypeVar("C", bound=ExchangeConfig)


class CompressedAdam(torch.optim.Optimizer, Generic[C]):
    """AdamW's state and update, with the exchanges of the compressed variants; the variant's
    config is ``config``, and a variant with state of its own sets it in ``_start``.

    Args:
        params: the parameters (or parameter groups) to optimise, as for ``torch.optim.AdamW``.
        comm: the data-parallel group.
        config: the variant's config: its ``exchange`` (``onebit`` or ``none``), the
            algorithms of the 1-bit allreduce's two phases and of the full-precision allreduce,
            and the variant's own settings.
        lr: learning rate.
        betas: ``(beta1, beta2)``, the decays of the momentum and of the variance.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW's).

    Raises:
        ValueError: a negative learning rate, eps or weight decay, betas outside [0, 1).
    """

    def __init__(
        self,
        params: Iterable[Any],
        comm: Communicator,
        config: C,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}"
            )
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.comm = comm
        self.config: C = config
        self.exchange = config.exchange
        self.algo = config.algo
        self.onebit = CompressedAllReduce(
            all_to_all_algo=config.all_to_all_algo, all_gather_algo=config.all_gather_algo
        )
        self.step_count = 0
        """Steps taken (t)."""
        self.variance_updates = 0
        """Variance updates so far (k), for the variance's bias correction."""
        self.exchanges = 0
        """Compressed (or fp32, with ``exchange="none"``) exchanges so far."""
        self._start()

    def _start(self) -> None:
        """Set the variant's own state, once the shared state and ``config`` are set (none by
        default)."""

    # -- parameters as one flat buffer ------------------------------------------------------
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(exp_avg, exp_avg_sq)`` of ``p``, created at zero on ``p``'s device."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"], state["exp_avg_sq"]

    def gradients(self) -> list[torch.Tensor]:
        """Every parameter's gradient (zeros for a parameter without one)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params()]

    @staticmethod
    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    @staticmethod
    def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    # -- exchanges --------------------------------------------------------------------------
    def average_gradients(self) -> list[torch.Tensor]:
        """The gradients averaged over the ranks in full precision (one allreduce)."""
        grads = self.gradients()
        if self.comm.world_size == 1:
            return grads
        flat = self.flat(grads)
        collectives.all_reduce(self.comm, flat, "avg", algo=self.algo)
        out = [torch.empty_like(g) for g in grads]
        self.unflatten_into(flat, out)
        return out

    def exchange_(self, tensors: list[torch.Tensor], *, key: str) -> None:
        """Replace ``tensors`` by their average over the ranks, in place: the 1-bit allreduce
        with the residuals of ``key``, or an fp32 allreduce."""
        flat = self.flat(tensors)
        if self.exchange == "onebit":
            self.onebit.all_reduce_(self.comm, flat, key=key)
        elif self.comm.world_size > 1:
            collectives.all_reduce(self.comm, flat, "avg", algo=self.algo)
        self.unflatten_into(flat, tensors)
        self.exchanges += 1

    # -- the update -------------------------------------------------------------------------
    @staticmethod
    def update_momentum_(m: torch.Tensor, grad: torch.Tensor, beta1: float) -> None:
        m.lerp_(grad, 1 - beta1)

    @staticmethod
    def update_variance_(v: torch.Tensor, grad: torch.Tensor, beta2: float) -> None:
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def denominator(self, v: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``sqrt(v) / sqrt(1 - beta2^k) + eps``."""
        beta2: float = group["betas"][1]
        correction = 1 - beta2 ** max(self.variance_updates, 1)
        denominator: torch.Tensor = (v.sqrt() / correction**0.5).add_(group["eps"])
        return denominator

    def step_size(self, group: dict[str, Any]) -> float:
        """``lr / (1 - beta1^t)``."""
        lr: float = group["lr"]
        beta1: float = group["betas"][0]
        return lr / (1 - beta1**self.step_count)

    def apply_update_(
        self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict[str, Any]
    ) -> None:
        """AdamW's step of ``p`` from ``m`` and ``v`` (the module docstring)."""
        with torch.no_grad():
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(m, self.denominator(v, group), value=-self.step_size(group))

    @staticmethod
    def mask_unseen_(m: torch.Tensor, v: torch.Tensor) -> None:
        """Zero ``m`` where the variance ``v`` is zero (the module docstring)."""
        m.masked_fill_(v == 0, 0.0)

    def adam_step_(self, grads: list[torch.Tensor]) -> None:
        """One step of plain AdamW on ``grads`` (already averaged): both moments updated."""
        self.variance_updates += 1
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m, v = self.moments(p)
                self.update_momentum_(m, grads[index], beta1)
                self.update_variance_(v, grads[index], beta2)
                self.apply_update_(p, m, v, group)
                index += 1

    def onebit_momentum_step_(self, grads: list[torch.Tensor]) -> None:
        """One step with the variance frozen: the momentum takes this rank's own gradient, is
        averaged by ``exchange_`` and steps the parameters."""
        momenta = []
        index = 0
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                m, _ = self.moments(p)
                self.update_momentum_(m, grads[index], beta1)
                momenta.append(m)
                index += 1
        self.exchange_(momenta, key="momentum")
        for group in self.param_groups:
            for p in group["params"]:
                m, v = self.moments(p)
                self.mask_unseen_(m, v)
                self.apply_update_(p, m, v, group)

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (moments per parameter) plus the step counters and the 1-bit
        allreduce's residuals: everything an exact resume needs."""
        state = super().state_dict()
        state["compressed"] = {
            "step_count": self.step_count,
            "variance_updates": self.variance_updates,
            "exchanges": self.exchanges,
            "onebit": self.onebit.state_dict(),
            **self.extra_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``."""
        state = dict(state_dict)
        extra = state.pop("compressed")
        super().load_state_dict(state)
        self.step_count = int(extra["step_count"])
        self.variance_updates = int(extra["variance_updates"])
        self.exchanges = int(extra["exchanges"])
        self.onebit.load_state_dict(extra["onebit"])
        self.load_extra_state(extra)

    def extra_state(self) -> dict[str, Any]:
        """A subclass's own state for ``state_dict`` (none here)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore ``extra_state()``."""

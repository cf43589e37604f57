"""Learning-rate schedules: the factor each step's learning rate is multiplied by.

A schedule is a pure function of the step, ``factor(step, total_steps)``: the training loop
sets every parameter group's learning rate to ``base_lr * factor`` before the step, where
``base_lr`` is the group's rate as the workload built its optimizer. Nothing about it is
stored, so a resumed run, a run continued from a checkpoint (``init_from``) and every rank of
every strategy agree on each step's rate without checkpointing a scheduler.

Three shapes, each after a linear warm-up of ``warmup_steps`` (step s < W trains at
``(s + 1) / W`` of the rate, so the first step already moves; Goyal et al., "Accurate, Large
Minibatch SGD: Training ImageNet in 1 Hour", 2017):

* ``ConstantSchedule`` (``constant``): the base rate after the warm-up.
* ``CosineSchedule`` (``cosine``): half a cosine from the base rate down to
  ``min_ratio`` of it at the run's last step (Loshchilov and Hutter, "SGDR: Stochastic Gradient
  Descent with Warm Restarts", ICLR 2017, without the restarts). DiLoCo's inner AdamW trains
  on this schedule (Douillard et al. 2023).
* ``StepSchedule`` (``step``): the rate multiplied by ``gamma`` every ``every_steps`` steps
  after the warm-up (torch's ``StepLR``; the ResNet recipes' drops, Goyal et al. 2017).

The step counts the run's whole training: a run continued from a checkpoint at step 200 takes
its step 200 at ``factor(200, total_steps)``, with ``total_steps`` the run's total
(``TrainConfig.steps``). Steps past the total (``TrainConfig.extra_steps``) keep the last
step's factor.

Local-SGD methods scale their inner rate on top (``inner_lr_scale``); an outer optimizer
(DiLoCo's Nesterov step) keeps its own rate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Warmup:
    warmup_steps: int = 0
    """Steps of linear warm-up from 1/W of the rate to the full rate (0: none)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def _warm(self, step: int) -> float | None:
        """The warm-up's factor at ``step``, None after the warm-up."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstantSchedule(_Warmup):
    """The base rate, after an optional linear warm-up."""

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the base rate at 0-based ``step`` of a ``total_steps`` run."""
        warm = self._warm(step)
        return 1.0 if warm is None else warm


@dataclasses.dataclass(frozen=True, kw_only=True)
class CosineSchedule(_Warmup):
    """Linear warm-up, then half a cosine from the base rate to ``min_ratio`` of it."""

    min_ratio: float = 0.1
    """The factor the cosine reaches at the run's last step (0: decay to zero)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio}")

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the base rate at 0-based ``step`` of a ``total_steps`` run."""
        warm = self._warm(step)
        if warm is not None:
            return warm
        # Progress runs from 0 at the first step after the warm-up to 1 at the last step.
        span = max(total_steps - 1 - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSchedule(_Warmup):
    """Linear warm-up, then the rate times ``gamma`` every ``every_steps`` steps."""

    every_steps: int
    """Steps between two drops, counted from the end of the warm-up."""
    gamma: float = 0.1
    """What each drop multiplies the rate by."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the base rate at 0-based ``step`` of a ``total_steps`` run."""
        warm = self._warm(step)
        if warm is not None:
            return warm
        last = max(total_steps - 1, 0)
        drops = (min(step, last) - self.warmup_steps) // self.every_steps
        return float(self.gamma**drops)


LRSchedule = ConstantSchedule | CosineSchedule | StepSchedule
"""Any schedule ``TrainConfig.lr_schedule`` takes."""

SCHEDULES: dict[str, type[LRSchedule]] = {
    "constant": ConstantSchedule,
    "cosine": CosineSchedule,
    "step": StepSchedule,
}
"""Every schedule by the name its spec gives it (``--lr-schedule cosine:warmup_steps=20``)."""


def describe_schedule(schedule: LRSchedule) -> str:
    """The schedule as a spec (``cosine:warmup_steps=20,min_ratio=0.1``)."""
    name = next(n for n, cls in SCHEDULES.items() if type(schedule) is cls)
    # Every schedule has fields (the warm-up's at least), so the spec always has a colon.
    fields = [f"{f.name}={getattr(schedule, f.name)}" for f in dataclasses.fields(schedule)]
    return f"{name}:{','.join(fields)}"


class ScheduledRates:
    """Sets parameter groups' learning rates from a schedule, step by step.

    Args:
        schedule: the schedule, or None (the rates are never touched).
        optimizer: the optimizer as the workload built it, before any checkpoint or peer's
            state put its last scheduled rate there: each group's rate now is its base rate.
        total_steps: the run's total steps (``TrainConfig.steps``).
    """

    def __init__(
        self, schedule: LRSchedule | None, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> None:
        self.schedule, self.total_steps = schedule, total_steps
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]

    def apply(self, groups: list[dict[str, Any]], step: int) -> None:
        """Set each of ``groups``' ``lr`` to its base rate times the factor at ``step``.

        Raises:
            ValueError: ``groups`` are not as many as the base rates.
        """
        if self.schedule is None:
            return
        if len(groups) != len(self.base_lrs):
            raise ValueError(
                f"the schedule has {len(self.base_lrs)} base rates, the optimizer "
                f"{len(groups)} parameter groups"
            )
        factor = self.schedule.factor(step, self.total_steps)
        for group, base in zip(groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

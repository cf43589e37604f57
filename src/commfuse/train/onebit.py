"""Strategies whose optimizer communicates: 1-bit Adam and 0/1 Adam (``commfuse.optim``).

``OneBitAdamConfig()`` (``onebit-adam``) and ``ZeroOneAdamConfig()`` (``zeroone-adam``): the
model is not wrapped; the workload's AdamW is replaced by the compressed optimizer with the
same parameter groups and hyper-parameters (learning rate, betas, eps, weight decay), which
averages what it needs itself in ``step()``. A run that starts from a trained model
(``--init-from``) continues that AdamW's moments and step count, so its variance is warm
already: the warm-up (``freeze_step``, ``var_freeze_step``) counts from the first step of the
model's whole training.

Bytes per step are what the communicator counted (payload handed to collectives, as for the
other strategies). The checkpoint holds the optimizer's ``state_dict`` (moments, step counters,
the 1-bit allreduce's residuals, 0/1 Adam's synchronised parameters and accumulated update), so
a resume is bit-identical. ``no_sync`` (the compute-only timing) steps the workload's own
AdamW, whose state the run never uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from commfuse.optim import OneBitAdam, OneBitAdamConfig, ZeroOneAdam, ZeroOneAdamConfig
from commfuse.train.strategy import Strategy, StrategyContext, register_builder

#: The AdamW settings a parameter group carries over to the compressed optimizer.
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def _adam_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer``'s parameter groups with their AdamW settings.

    Raises:
        ValueError: ``optimizer`` is not an Adam-family optimizer (no ``betas``).
    """
    groups = []
    for group in optimizer.param_groups:
        missing = [k for k in _ADAM_KEYS if k not in group]
        if missing:
            raise ValueError(
                f"1-bit Adam and 0/1 Adam replace the workload's Adam(W), but its optimizer is "
                f"{type(optimizer).__name__} (no {', '.join(missing)}); use a workload trained "
                "with AdamW (charlm, digits)"
            )
        groups.append({"params": group["params"], **{k: group[k] for k in _ADAM_KEYS}})
    return groups


class _CompressedAdamStrategy(Strategy):
    """One rank of a 1-bit Adam or 0/1 Adam run."""

    def __init__(self, config: OneBitAdamConfig | ZeroOneAdamConfig, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        groups = _adam_groups(ctx.optimizer)
        self.compressed: OneBitAdam | ZeroOneAdam
        if isinstance(config, OneBitAdamConfig):
            self.compressed = OneBitAdam(groups, ctx.comm, config)
        else:
            self.compressed = ZeroOneAdam(groups, ctx.comm, config)
        self._continue_moments(ctx.optimizer)
        self._communicate = True

    def lr_groups(self) -> list[dict[str, Any]]:
        return self.compressed.param_groups

    def _continue_moments(self, adam: torch.optim.Optimizer) -> None:
        """Take over the moments and step count of the AdamW the run starts from (if any)."""
        steps = []
        for p in self.compressed.params():
            state = adam.state.get(p, {})
            if "exp_avg" in state:
                m, v = self.compressed.moments(p)
                m.copy_(state["exp_avg"])
                v.copy_(state["exp_avg_sq"])
                steps.append(int(float(state["step"])))
        if steps:
            self.compressed.step_count = max(steps)
            self.compressed.variance_updates = max(steps)

    @property
    def model(self) -> nn.Module:
        return self.module

    def optimizer_step(self) -> bool:
        if self._communicate:
            self.compressed.step()
        else:
            self.optimizer.step()
        return True

    def zero_grad(self) -> None:
        self.compressed.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    def bytes_sent(self) -> int:
        return self.comm.stats.total().handed_bytes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._communicate = False
        try:
            yield
        finally:
            self._communicate = True

    def finish(self) -> None:
        """0/1 Adam: synchronise the local steps since the last synchronisation."""
        if isinstance(self.compressed, ZeroOneAdam):
            self.compressed.finish()

    def metrics(self) -> dict[str, Any]:
        """Steps taken, variance updates and compressed exchanges (0/1 Adam: how many rounds
        were skipped is the steps without either)."""
        return {
            "steps": self.compressed.step_count,
            "variance_updates": self.compressed.variance_updates,
            "exchanges": self.compressed.exchanges,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"compressed_adam": self.compressed.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "compressed_adam" not in state:
            raise ValueError("checkpoint has no compressed-Adam state (moments, residuals)")
        self.compressed.load_state_dict(state["compressed_adam"])


register_builder(OneBitAdamConfig, _CompressedAdamStrategy)
register_builder(ZeroOneAdamConfig, _CompressedAdamStrategy)

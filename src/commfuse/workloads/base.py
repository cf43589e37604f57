"""What a training workload is: a model, its optimizer, deterministic batches, a loss, an evaluation.

A workload owns everything that is not about communication, so every strategy (torch DDP, the
commfuse engine with or without compression, local SGD, ...) is compared on exactly the same
model, data and optimizer. Batches are a pure function of ``(seed, step, rank)``: a run resumed
from a checkpoint at step k sees exactly the batches the uninterrupted run saw from step k on,
with no data-loader state to save.

A workload is configured by a typed options dataclass (``CharLMConfig(dim=64, layers=1)``);
on the command line, ``charlm:dim=64,layers=1`` builds the same (``commfuse.cli.spec``).

A workload lives on one device, given when it is built (the rank's ``Communicator.device``:
``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo): its model's parameters, and so the
optimizer's state, and every batch it hands out are there. Initial weights and batches are
drawn from seeded CPU generators and then moved, so every device trains on the same numbers.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn


class Workload(abc.ABC):
    """One model + data set + optimizer. Subclasses set ``name`` and implement the methods."""

    name: str = ""
    """Registry name (``--workload NAME``)."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        """Where the model, its optimizer's state and every batch live."""

    @abc.abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """The model with parameters drawn from ``seed`` (identical on every rank and device),
        on ``self.device``."""

    @abc.abstractmethod
    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s trainable parameters."""

    @abc.abstractmethod
    def batch(self, step: int, rank: int, world_size: int, *, seed: int) -> Any:
        """Rank ``rank``'s batch at ``step`` on ``self.device``: a pure function of (seed, step,
        rank, world_size)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``model`` (possibly a DDP wrapper) on ``batch``."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out ``{"loss": ..., "accuracy": ...}`` (no gradient, data disjoint from training)."""

    def describe(self) -> str:
        """One line for tables and logs."""
        return self.name


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A generator seeded from (seed, step, rank) only, so batches never depend on history.

    The three numbers are mixed with large odd constants (as in SplitMix-style hashing) so that
    neighbouring steps and ranks get unrelated streams.
    """
    if step < 0 or rank < 0:
        raise ValueError(f"step and rank must be >= 0, got step={step}, rank={rank}")
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) % (
        2**63
    )
    gen = torch.Generator()
    gen.manual_seed(mixed)
    return gen

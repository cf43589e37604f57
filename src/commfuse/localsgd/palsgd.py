"""PALSGD: DiLoCo with probabilistic pseudo-synchronisation, for longer periods.

Naganuma et al., "Pseudo-Asynchronous Local SGD: Robust and Efficient Data-Parallel Training"
(2025). DiLoCo's replicas drift apart during a period, and the drift, not the number of inner
steps, is what limits H. PALSGD pulls each replica back toward the last synchronised model at
random steps, without communicating:

1. at every inner step a coin with probability ``p`` is drawn, from a generator seeded with
   ``seed`` and the same on every rank (every rank draws the same coins, in the same order);
2. heads: the step is a pseudo-synchronisation instead of a gradient step,
   ``params <- params + pull (anchor - params)``, toward the anchor (the model of the last
   synchronisation, which every rank holds); the gradient of that step is not used;
3. tails: the inner optimizer's usual step;
4. every H steps, DiLoCo's exchange: the averaged pseudo-gradient and the outer Nesterov step.

``p = 0`` is DiLoCo, bit for bit. The pulls bound the drift, so H can grow (fewer bytes) at the
same loss. Tune ``p`` between 0.01 and 0.1 and ``pull`` around 0.5, then raise H past what
DiLoCo tolerates.

Bytes per rank: DiLoCo's, the model every H steps (the pulls send nothing).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from commfuse.localsgd.config import PeriodicSyncConfig
from commfuse.localsgd.diloco import diloco
from commfuse.localsgd.sync_method import ExchangeSettings, SyncMethodOptimizer


@dataclass(frozen=True, kw_only=True)
class PALSGDConfig(ExchangeSettings):
    """PALSGD (Naganuma et al. 2025): DiLoCo plus pulls toward the last synchronised model at
    random steps (probability ``p``)."""

    name = "palsgd"

    H: int = 100
    """Inner steps between two outer steps (longer than DiLoCo's: the pulls bound the drift)."""
    p: float = 0.05
    """Probability that an inner step is a pseudo-synchronisation (0: DiLoCo)."""
    pull: float = 0.5
    """Fraction of the way to the last synchronised model a pseudo-synchronisation goes."""
    seed: int = 0
    """Seed of the coins (the same on every rank)."""
    outer_lr: float = 0.7
    """Outer learning rate (DiLoCo's)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (DiLoCo's)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD."""

    def __post_init__(self) -> None:
        if not 0 <= self.p <= 1:
            raise ValueError(f"p must be in [0, 1], got {self.p}")
        if not 0 < self.pull <= 1:
            raise ValueError(f"pull must be in (0, 1], got {self.pull}")
        self.periodic()  # the shared settings' own checks

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: DiLoCo's."""
        return diloco(
            H=self.H,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            nesterov=self.nesterov,
            inner_lr_scale=self.inner_lr_scale,
            compressor=self.compressor,
            algo=self.algo,
            final_sync=self.final_sync,
        ).periodic()


class PALSGDOptimizer(SyncMethodOptimizer[PALSGDConfig]):
    """DiLoCo whose inner steps are pseudo-synchronisations with probability ``p`` (the module
    docstring); ``pulls`` lists the steps that were. The inner optimizer is DiLoCo's, AdamW."""

    def _start(self) -> None:
        # Python's generator, not torch's: the coins must not consume the global torch stream
        # (p = 0 is DiLoCo bit for bit) and its state checkpoints as plain data.
        self.coins = random.Random(self.method.seed)
        self.pulls: list[int] = []
        """Steps (1-based) that were pseudo-synchronisations (the same on every rank)."""

    def _inner_step(self, lr_scale: float) -> None:
        heads = self.coins.random() < self.method.p
        if not heads:
            super()._inner_step(lr_scale)
            return
        self.pulls.append(self.step_count + 1)
        with torch.no_grad():
            for f, anchor in enumerate(self.anchors):
                flat = self._flat(f)
                self._write(f, flat.add_(anchor - flat, alpha=self.method.pull))

    def state_dict(self) -> dict[str, Any]:
        """The shared state, and the coins' generator and the pulls so far."""
        state = super().state_dict()
        version, words, gauss = self.coins.getstate()
        state["palsgd"] = {"coins": [version, list(words), gauss], "pulls": list(self.pulls)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        version, words, gauss = state["palsgd"]["coins"]
        self.coins.setstate((version, tuple(words), gauss))
        self.pulls = list(state["palsgd"]["pulls"])


PALSGDConfig.optimizer_class = PALSGDOptimizer

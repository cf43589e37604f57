"""Deep Gradient Compression (Lin et al. 2018): top-k of momentum-corrected, accumulated
gradients, with momentum factor masking and a warm-up of the sparsity.

Sparsifying the raw gradient and then applying momentum SGD loses the momentum of everything
that was not sent. DGC moves the momentum into the compressor, per bucket:

1. momentum correction: ``u = m u + g``, ``v = v + u`` (``v`` is the accumulated update: the
   error-feedback residual of the momentum, not of the gradient);
2. send the top-k of ``|v|`` (values + int32 indices, allgathered as for ``topk``);
3. momentum factor masking: where an entry was sent, clear both ``v`` and ``u``, so stale
   momentum does not keep pushing a coordinate that was just applied;
4. warm-up: during the first ``warmup`` steps the density decays exponentially from 25% to
   ``ratio`` (the paper: 75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity over four epochs),
   which keeps the early, fast-changing gradients from going stale.

The output is already a momentum update: use the optimizer WITHOUT momentum (plain SGD). The
paper's local gradient clipping is left to the training loop. Round-trip error per step as for
top-k, on ``v``; the residual ``v`` stays bounded because every entry is eventually sent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from commfuse.comm import Communicator
from commfuse.compress.layout import BucketLayout, move_elementwise
from commfuse.compress.sparse import TopK, num_kept, top_k

_WARMUP_START_DENSITY = 0.25
"""The density DGC's warm-up starts from (75% sparsity, the paper's first epoch)."""


@dataclasses.dataclass(kw_only=True)
class DGC(TopK):
    """Top-k of the momentum-corrected accumulation, with masking and sparsity warm-up."""

    name: ClassVar[str] = "dgc"
    own_state: ClassVar[tuple[str, ...]] = ("feedback", "velocities")
    ratio: float = 0.001
    """Fraction of the bucket's elements sent each step after the warm-up."""
    momentum: float = 0.9
    """Momentum factor ``m`` (the optimizer itself should not add momentum)."""
    warmup: int = 0
    """Steps over which the density decays from 25% to ``ratio``."""
    velocities: dict[str, torch.Tensor] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """The momentum ``u`` per bucket, keyed like the residuals (``layout.py``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ef:
            raise ValueError("dgc: the accumulation IS its error feedback; drop ef=0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"dgc: momentum must be in [0, 1), got {self.momentum}")
        if self.warmup < 0:
            raise ValueError(f"dgc: warmup must be >= 0 steps, got {self.warmup}")

    def density(self, step: int | None) -> float:
        """The fraction sent at ``step`` (None: after the warm-up)."""
        if step is None or step >= self.warmup or self.ratio >= _WARMUP_START_DENSITY:
            return self.ratio
        return float(
            _WARMUP_START_DENSITY * (self.ratio / _WARMUP_START_DENSITY) ** (step / self.warmup)
        )

    def k_for(self, numel: int, step: int | None) -> int:
        return num_kept(self.density(step), numel)

    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        numel = grad.numel()
        key = self._state_key(bucket)
        old = self.velocities.get(key)
        u = grad.clone() if old is None or old.shape != grad.shape else old * self.momentum + grad
        v = self.feedback.corrected(key, u)
        values, indices = top_k(v, self.k_for(numel, step))
        if commit:
            v[indices.long()] = 0
            u[indices.long()] = 0  # momentum factor masking
            self.feedback.update(key, v)
            self.velocities[key] = u
        gathered = self._exchange(comm, self.layout(numel, grad.dtype, step), [values, indices])
        total = self.decompress_sum(gathered, numel, grad.dtype, step)
        grad.copy_(total.div_(comm.world_size))

    def _state_stores(self) -> list[dict[str, torch.Tensor]]:
        return [*super()._state_stores(), self.velocities]

    def _move_state(
        self, bucket: int, layout: BucketLayout, sources: dict[str, BucketLayout]
    ) -> None:
        super()._move_state(bucket, layout, sources)
        move_elementwise(self.velocities, layout, sources, self.state_moves)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "velocities": {b: u.clone() for b, u in self.velocities.items()},
        }

    def _load_stores(self, state: dict[str, Any]) -> None:
        super()._load_stores(state)
        self.velocities = {str(b): u.clone() for b, u in state["velocities"].items()}

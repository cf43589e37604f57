"""Error feedback: what a lossy compressor did not send this step is added to the next step.

Error feedback (Seide et al. 2014, "1-bit SGD"; Stich et al. 2018, "Sparsified SGD with
memory"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD") keeps, per bucket, the
residual ``e`` between what the rank wanted to send and what its message decodes to:

1. ``x = g + e``          (correct this step's gradient by last step's residual)
2. send ``C(x)``          (the compressed message)
3. ``e = x - D(C(x))``    (remember what was lost)

so the sum over steps of what was sent plus the current residual equals the sum of true
gradients exactly: nothing is dropped, only delayed, and biased compressors (top-k, sign)
converge like SGD. The residuals are their own state object, so a checkpoint holds them and a
resumed run continues bit for bit.

Residuals are filed under the bucket's state key (its ``BucketLayout.key``, see ``layout.py``),
so a residual stays with its parameters when buckets are laid out anew; a residual whose size
does not match the bucket it is asked for is ignored (the bucket starts from zero).

Undoing a step. A caller that may have to undo a step (a fault-tolerant step that fails on
some replicas after others updated their residuals) ``keep``s the residuals before it: no
copy is made; instead, until the next ``keep``, ``add_to_`` hands out a spare buffer rather
than a kept residual's storage, so the kept tensors stay as they were, and the spare is the
buffer the previous ``keep`` held (no allocation either, once there is one per bucket).
Copying a bucket-sized residual every step costs a pass over memory that a short step feels.
"""

from __future__ import annotations

from typing import Any

import torch


class ErrorFeedback:
    """Per-bucket residuals ``e_b`` (flat tensors of the bucket's size and dtype), keyed by the
    bucket's state key."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self._kept: dict[str, torch.Tensor] = {}
        """The residuals of the last ``keep``: never written in place until the next."""
        self._spares: dict[str, torch.Tensor] = {}
        """Buffers ``add_to_`` hands out in place of a kept residual's storage."""

    def keep(self) -> dict[str, torch.Tensor]:
        """The residuals as they are now, without a copy (see the module docstring): they stay
        unchanged until the next ``keep``; ``load_state_dict({"residuals": kept})`` goes back
        to them."""
        for key, old in self._kept.items():
            if self.residuals.get(key) is not old:  # replaced since: no longer anyone's
                self._spares[key] = old
        # A bucket laid out anew files its residual under another key: drop the old spares.
        self._spares = {k: e for k, e in self._spares.items() if k in self.residuals}
        self._kept = dict(self.residuals)
        return dict(self._kept)

    def corrected(self, key: str, grad: torch.Tensor, *, decay: float = 1.0) -> torch.Tensor:
        """``grad + decay e_key`` as a new tensor (``grad`` itself is left alone); ``decay``
        below 1 lets old residual mass fade (``chunked.DecayedFeedbackCompressor``)."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            return grad.clone()
        return torch.add(grad, residual, alpha=decay)

    def add_to_(self, key: str, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad += e_key`` IN PLACE (for a compressor that overwrites ``grad`` anyway);
        returns ``e_key``, whose storage the caller may overwrite with the next residual
        before handing it to ``update`` (no new bucket-sized buffer per step), or None. A
        kept residual (``keep``) is not handed out: a spare buffer of its size is, instead."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            return None
        grad.add_(residual)
        if self._kept.get(key) is not residual:
            return residual
        spare = self._spares.pop(key, None)
        if spare is None or spare.shape != residual.shape or spare.dtype != residual.dtype:
            spare = torch.empty_like(residual)
        return spare

    def update(self, key: str, residual: torch.Tensor) -> None:
        """Store the new residual (the caller commits only finite ones)."""
        self.residuals[key] = residual

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {b: e.clone() for b, e in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {str(b): e.clone() for b, e in state["residuals"].items()}

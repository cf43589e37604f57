"""Streaming DiLoCo: DiLoCo whose fragments synchronise at staggered steps, in the background.

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025). Three changes to
DiLoCo (``diloco.py``), each cutting what the slow links must carry at once:

1. the parameters are cut into ``num_fragments`` fragments (``fragments.py``), and fragment f
   synchronises at the steps where ``(step - f H / F)`` is a multiple of H: every fragment
   still once per period, but each exchange is 1/F of the model, so the peak bandwidth falls F
   times;
2. each exchange runs in the background for ``overlap_steps`` inner steps (tau) and is applied
   then, so the training does not wait for it;
3. the result is merged with the local progress made meanwhile:
   ``params = mix_global * anchor + (1 - mix_global) * params``.

The paper's settings: F = 4 (or one fragment per few layers), tau = 1, mix 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSettings, PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.diloco import outer_step, warn_outer_recipe


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCoConfig(PeriodicSettings):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo whose fragments synchronise at
    staggered steps, each exchange overlapped with inner steps and mixed with the local
    progress."""

    name = "streaming-diloco"

    H: int = 50
    """Inner steps between two synchronisations of a fragment."""
    num_fragments: int = 4
    """Fragments of the parameters, synchronised at staggered steps (F)."""
    overlap_steps: int = 1
    """Inner steps an exchange runs in the background before it is applied (tau)."""
    mix_global: float = 0.5
    """Weight of the synchronised value against the local progress made meanwhile."""
    outer_lr: float | None = None
    """As ``DiLoCoConfig.outer_lr``."""
    outer_momentum: float | None = None
    """As ``DiLoCoConfig.outer_momentum``."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD."""

    def __post_init__(self) -> None:
        warn_outer_recipe(self.compressor, self.outer_lr, self.outer_momentum)
        super().__post_init__()

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: DiLoCo's outer step, fragmented and overlapped."""
        outer_lr, outer_momentum = outer_step(self.compressor, self.outer_lr, self.outer_momentum)
        return PeriodicSyncConfig(
            H=self.H,
            num_fragments=self.num_fragments,
            overlap_steps=self.overlap_steps,
            mix_global=self.mix_global,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=self.nesterov,
            **self.shared(),
        )


def streaming_diloco(
    *,
    H: int = 50,
    num_fragments: int = 4,
    overlap_steps: int = 1,
    mix_global: float = 0.5,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    nesterov: bool = True,
    **shared: Unpack[SyncOptions],
) -> StreamingDiLoCoConfig:
    """Streaming DiLoCo with period ``H``, ``num_fragments`` fragments, exchanges overlapped
    with ``overlap_steps`` inner steps and merged with weight ``mix_global``. The outer step is
    ``diloco``'s (its defaults, a compressor's ``outer_recipe`` included); ``shared`` as for
    ``local_sgd``.

    Example::

        config = streaming_diloco(H=50, num_fragments=4)
    """
    return StreamingDiLoCoConfig(
        H=H,
        num_fragments=num_fragments,
        overlap_steps=overlap_steps,
        mix_global=mix_global,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        **shared,
    )

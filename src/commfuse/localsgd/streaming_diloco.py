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

import dataclasses

from typing_extensions import Unpack

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.diloco import diloco


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
) -> PeriodicSyncConfig:
    """Streaming DiLoCo with period ``H``, ``num_fragments`` fragments, exchanges overlapped
    with ``overlap_steps`` inner steps and merged with weight ``mix_global``. The outer step is
    ``diloco``'s (its defaults, a compressor's ``outer_recipe`` included); ``shared`` as for
    ``local_sgd``.

    Example::

        config = streaming_diloco(H=50, num_fragments=4)
    """
    outer = diloco(
        H=H,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        compressor=shared.get("compressor"),
    )
    return dataclasses.replace(
        outer,
        num_fragments=num_fragments,
        overlap_steps=overlap_steps,
        mix_global=mix_global,
        **shared,
    )

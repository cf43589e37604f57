"""Layer 2: collectives that fit the message, built on the communicator's point-to-point sends.

Front door: ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter`` and
``all_to_all``, each taking ``algo=`` (``"auto"`` or a registered name) and ``async_op=``.

The front door and the algorithms need torch; the cost models (``cost.py``), the registry's
names and the tuner's choice (``tuner.choose_for``) do not, and the simulator prices clusters
with them alone. So the front door loads on first use (``commfuse.lazy``): importing
``commfuse.collectives.cost`` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commfuse.lazy import attach

if TYPE_CHECKING:
    from commfuse.collectives.api import (
        all_gather,
        all_reduce,
        all_to_all,
        broadcast,
        reduce,
        reduce_scatter,
    )
    from commfuse.collectives.registry import ALGORITHMS, algorithms_for

__all__ = [
    "ALGORITHMS",
    "algorithms_for",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "reduce_scatter",
]

__getattr__, __dir__ = attach(
    __name__,
    {
        "ALGORITHMS": "commfuse.collectives.registry",
        "algorithms_for": "commfuse.collectives.registry",
        **{
            name: "commfuse.collectives.api"
            for name in (
                "all_gather",
                "all_reduce",
                "all_to_all",
                "broadcast",
                "reduce",
                "reduce_scatter",
            )
        },
    },
)

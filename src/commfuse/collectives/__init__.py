"""Layer 2: collectives that fit the message, built on the communicator's point-to-point sends.

Front door: ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter`` and
``all_to_all``, each taking ``algo=`` (``"auto"`` or a registered name) and ``async_op=``.
"""

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

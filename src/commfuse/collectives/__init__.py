"""Layer 2: collectives that fit the message, built on the communicator's point-to-point sends.

Front door: ``allreduce``, ``broadcast``, ``reduce``, ``allgather``, ``reduce_scatter`` and
``all_to_all``, each taking ``algo=`` (``"auto"`` or a registered name) and ``async_op=``.
"""

from commfuse.collectives.api import (
    all_to_all,
    allgather,
    allreduce,
    broadcast,
    reduce,
    reduce_scatter,
)
from commfuse.collectives.registry import ALGORITHMS, algorithms_for

__all__ = [
    "ALGORITHMS",
    "algorithms_for",
    "all_to_all",
    "allgather",
    "allreduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
]

"""Layer 2: collectives that fit the message, built on the communicator's point-to-point sends.

Front door: ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter`` and
``all_to_all``. Besides its own buffers each takes the same arguments, returns the same thing
and fails the same way, said once here (each function's entry says only what is its own):

**Arguments every collective takes**

- ``comm``: the ``Communicator`` whose group the collective runs over; every rank of the group
  makes the same call.
- ``algo``: ``"auto"`` (the tuner picks for this size and topology) or a registered algorithm
  or alias (``ALGORITHMS``: ``ring``, ``lp``, ``tree``, ``rabenseifner``, ...).
- ``async_op``: run on the communicator's worker thread and return a handle at once.
- ``**opts``: algorithm options (``block_bytes`` for pipelines, ``ranks_per_host`` for
  hierarchical ones); an algorithm ignores the ones it does not know.
- ``op``, for the reductions (``all_reduce``, ``reduce``, ``reduce_scatter``): ``sum``,
  ``avg``, ``prod``, ``max`` or ``min``.
- ``root``, for ``broadcast`` and ``reduce``: a rank of ``comm``.

**Returns**: with ``async_op``, a ``Handle`` whose ``wait()`` raises ``CommTimeoutError`` past
the communicator's deadline; otherwise None, the result in place when the call returns.

**Raises**

- ``ValueError``: a dtype outside float32, float64, float16, bfloat16, int32 and int64, a buffer
  that is not contiguous, an unknown op (or ``avg`` of integers) or algorithm, a root outside
  the group, or buffers whose sizes do not fit the collective (each function says how they
  must fit).
- ``InconsistentInputError``: with ``CommConfig(validate=True)``, ranks passed different
  shapes or dtypes (``all_to_all`` excepted: its ranks may send different amounts).
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

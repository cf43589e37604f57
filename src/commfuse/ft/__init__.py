"""Fault-tolerant data parallelism on torchft: replica groups that die, rejoin and catch up.

``run_fault_tolerant(TrainConfig(...), FaultToleranceConfig(...), Topology(...))`` trains with
one torchft replica group per emulated host (or ``num_replica_groups``; a group of several
ranks averages inside itself and across groups shard by shard: ``group_hook.py``): the
lighthouse (quorum) runs in the launcher on
the first host's address, each replica group runs torch DDP whose gradient hook averages across
the quorum through torchft's Manager, a replica that dies costs the step in flight, and a
restarted one receives its state from a healthy peer (checksummed) and continues in step.
With a local-SGD method as the strategy (``diloco(H=50)``, ``local_sgd(H=8)``, streaming
DiLoCo, any outer compressor) the unit of commit is a period of inner steps instead
(``periodic.py``): a failure costs the period in flight.
Needs the optional dependency (``pip install 'commfuse[ft]'``); importing this package does
not import torchft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commfuse.ft.config import (
    CutFault,
    FaultToleranceConfig,
    KillEveryFault,
    KillFault,
    SlowFault,
    Timeouts,
)
from commfuse.lazy import attach

if TYPE_CHECKING:
    from commfuse.ft.launch import run_fault_tolerant

__all__ = [
    "CutFault",
    "FaultToleranceConfig",
    "KillEveryFault",
    "KillFault",
    "SlowFault",
    "Timeouts",
    "run_fault_tolerant",
]

__getattr__, __dir__ = attach(__name__, {"run_fault_tolerant": "commfuse.ft.launch"})

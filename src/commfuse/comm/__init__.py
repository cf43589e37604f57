"""Layer 1: the transport seen by every algorithm (see ``communicator.py``)."""

from commfuse.comm.communicator import (
    CommConfig,
    Communicator,
    ReduceOpName,
    check_consistent,
    nbytes_of,
)
from commfuse.comm.errors import (
    CommError,
    CommTimeoutError,
    InconsistentInputError,
    PeerFailureError,
)
from commfuse.comm.handle import Handle, wait_all
from commfuse.comm.stats import CommStats, OpCounters
from commfuse.comm.trace import Trace, TraceEvent, merge_chrome_traces

__all__ = [
    "CommConfig",
    "CommError",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "Handle",
    "InconsistentInputError",
    "OpCounters",
    "PeerFailureError",
    "ReduceOpName",
    "Trace",
    "TraceEvent",
    "check_consistent",
    "merge_chrome_traces",
    "nbytes_of",
    "wait_all",
]

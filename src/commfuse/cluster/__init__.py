"""Layer 0: where ranks run. Launcher, emulated network (netlab), process-group set-up.

The launcher and the runner import torch (a rank's process group); the errors, the topology and
the emulated network do not, and the ``commfuse`` command needs only those to parse its
arguments and report a failure. So ``launch`` and ``run`` load on first use
(``commfuse.lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commfuse.cluster.errors import DeadlineExceeded, LaunchError, RankError
from commfuse.cluster.topology import Topology
from commfuse.lazy import attach

if TYPE_CHECKING:
    from commfuse.cluster.launcher import launch
    from commfuse.cluster.spawn import run

__all__ = ["DeadlineExceeded", "LaunchError", "RankError", "Topology", "launch", "run"]

__getattr__, __dir__ = attach(
    __name__, {"launch": "commfuse.cluster.launcher", "run": "commfuse.cluster.spawn"}
)

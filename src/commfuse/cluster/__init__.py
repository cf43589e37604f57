"""Layer 0: where ranks run. Launcher, emulated network (netlab), process-group set-up."""

from commfuse.cluster.errors import DeadlineExceeded, LaunchError, RankError
from commfuse.cluster.launcher import launch
from commfuse.cluster.spawn import run
from commfuse.cluster.topology import Topology

__all__ = ["DeadlineExceeded", "LaunchError", "RankError", "Topology", "launch", "run"]

"""The methods that decide *when* (or *what*) to synchronise, beyond a fixed period H.

Local SGD, SlowMo and (streaming) DiLoCo synchronise on a clock: every H steps, whatever the
replicas did. The methods here decide from what they measure: SelSync (``selsync.py``) from the
change of the gradient norm, ADPSGD (``adpsgd.py``) from the replicas' drift under a budget of
synchronisations, PALSGD (``palsgd.py``) adds random pulls toward the last synchronised model,
DreamDDP (``dreamddp.py``) averages one group of layers per step, overlapped with the backward
pass, and local SGD with clipping (``localsgd_clip.py``) clips every local step.

Each has a typed config, a subclass of ``SyncMethod``, that builds its optimizer (a
``PeriodicSyncOptimizer`` whose ``step()`` takes the method's decisions) with
``make_optimizer``. A decision that changes what is communicated is the same on every rank by
construction: it is agreed with a small integer allreduce (max or min, exact on every backend),
never read from floating-point values that could differ in their last bits between ranks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from commfuse import collectives

if TYPE_CHECKING:
    from torch import nn

    from commfuse.comm import Communicator
    from commfuse.localsgd.optimizer import PeriodicSyncOptimizer


@dataclass(frozen=True, kw_only=True)
class SyncMethod(abc.ABC):
    """Base of the configs of the methods that decide when or what to synchronise."""

    #: The method's name on the command line (``--strategy selsync:threshold=0.1``).
    name: ClassVar[str]

    def for_run(self, run_steps: int) -> SyncMethod:
        """This config with the settings it leaves to the run filled in from the run's length
        in steps (ADPSGD's ``total_steps``); the config itself by default."""
        return self

    @abc.abstractmethod
    def make_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, comm: Communicator
    ) -> PeriodicSyncOptimizer:
        """The method's optimizer around the inner ``optimizer`` of the replica ``module``."""


def agree(comm: Communicator, value: int, op: str, *, like: torch.Tensor) -> int:
    """``value`` reduced over every rank with ``op`` (``"max"`` or ``"min"``): one integer
    allreduce of one element (8 bytes per rank), exact, so every rank gets the same answer."""
    if comm.world_size == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=like.device)
    collectives.all_reduce(comm, flag, op, algo="native")
    return int(flag.item())


#: Bytes one rank hands to ``agree`` (one int64).
AGREE_BYTES = 8

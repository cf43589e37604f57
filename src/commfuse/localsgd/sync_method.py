"""The methods that decide *when* (or *what*) to synchronise, beyond a fixed period H.

Local SGD, SlowMo and (streaming) DiLoCo synchronise on a clock: every H steps, whatever the
replicas did. The methods here decide from what they measure: SelSync (``selsync.py``) from the
change of the gradient norm, ADPSGD (``adpsgd.py``) from the replicas' drift under a budget of
synchronisations, PALSGD (``palsgd.py``) adds random pulls toward the last synchronised model,
DreamDDP (``dreamddp.py``) averages one group of layers per step, overlapped with the backward
pass, and local SGD with clipping (``localsgd_clip.py``) clips every local step.

Each has a typed config, a subclass of ``SyncMethod``, that builds its optimizer with
``make_optimizer``: a ``SyncMethodOptimizer`` (a ``PeriodicSyncOptimizer`` run with the
config's ``periodic()`` settings) whose ``step()`` takes the method's decisions. A decision that changes what is communicated is the same on every rank by
construction: it is agreed with a small integer allreduce (max or min, exact on every backend),
never read from floating-point values that could differ in their last bits between ranks.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch
from torch import nn

from commfuse import collectives
from commfuse.comm import Communicator
from commfuse.compress.base import Compressor
from commfuse.localsgd.config import PeriodicSyncConfig
from commfuse.localsgd.optimizer import PeriodicSyncOptimizer
from commfuse.localsgd.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from commfuse.localsgd.sharded import refuse_sharded


@dataclass(frozen=True, kw_only=True)
class SyncMethod(abc.ABC):
    """Base of the configs of the methods that decide when or what to synchronise."""

    #: The method's name on the command line (``--strategy selsync:threshold=0.1``).
    name: ClassVar[str]
    #: The optimizer that runs the method (its module sets it, beside that class).
    optimizer_class: ClassVar[type[SyncMethodOptimizer[Any]]]

    def for_run(self, run_steps: int) -> SyncMethod:
        """This config with the settings it leaves to the run filled in from the run's length
        in steps (ADPSGD's ``total_steps``); the config itself by default."""
        return self

    def check_ready(self) -> None:
        """Raise ``ValueError`` when a setting the run fills in (``for_run``) is missing; every
        setting is known by default."""
        return None

    @abc.abstractmethod
    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: the period, the outer step and the exchange."""

    def make_optimizer(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, comm: Communicator
    ) -> SyncMethodOptimizer[Any]:
        """The method's optimizer (``optimizer_class``) around the inner ``optimizer`` of the
        replica ``module``.

        Raises:
            ValueError: a setting the run fills in is missing (``check_ready``).
        """
        self.check_ready()
        return self.optimizer_class(optimizer, module, comm, self)


@dataclass(frozen=True, kw_only=True)
class ExchangeSettings(SyncMethod):
    """A method whose exchanges are the shared machinery's whole-model averages (SelSync,
    ADPSGD, PALSGD, local SGD with clipping), with their settings; the command line lists a
    method's own settings first."""

    inner_lr_scale: float = 1.0
    """Multiplies the inner learning rate (as ``PeriodicSyncConfig.inner_lr_scale``)."""
    compressor: Compressor | None = None
    """Compresses each exchange (as ``PeriodicSyncConfig.compressor``); None: fp32."""
    algo: str = "auto"
    """commfuse allreduce algorithm of the uncompressed exchange."""
    final_sync: bool = True
    """Average the replicas at ``finish()`` when they moved since the last synchronisation."""

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config: plain averaging of the whole model, whenever the
        method's ``step()`` asks for it."""
        return PeriodicSyncConfig(
            H=1,
            inner_lr_scale=self.inner_lr_scale,
            compressor=self.compressor,
            algo=self.algo,
            final_sync=self.final_sync,
        )


#: The outer step of a method that averages the whole model (``outer.py``): ``average``, the
#: replicas' plain average (outer lr 1, no momentum: the papers' own); ``nesterov``, DiLoCo's
#: outer Nesterov SGD (lr 0.7, momentum 0.9) on the averaged pseudo-gradient.
OuterStep = Literal["average", "nesterov"]


def _with_outer_step(config: PeriodicSyncConfig, outer: OuterStep) -> PeriodicSyncConfig:
    """``config`` with the outer step ``outer`` (``OuterStep``). With ``nesterov`` each
    synchronisation, whenever the method decides it, is DiLoCo's: the momentum carries the
    direction of the averaged updates from one synchronisation to the next, so a method that
    synchronises on its own schedule moves the model as DiLoCo does on its clock.

    Raises:
        ValueError: ``outer`` is not an ``OuterStep``.
    """
    if outer not in ("average", "nesterov"):
        raise ValueError(f"outer must be 'average' or 'nesterov', got {outer!r}")
    if outer == "average":
        return config
    return dataclasses.replace(
        config,
        outer_lr=DILOCO_OUTER_LR,
        outer_momentum=DILOCO_OUTER_MOMENTUM,
        nesterov=True,
    )


@dataclass(frozen=True, kw_only=True)
class ExchangeSettingsWithOuterStep(ExchangeSettings):
    """``ExchangeSettings`` of a method that decides only when to average (SelSync, ADPSGD),
    with the step applied to the average: the papers' plain one, or DiLoCo's."""

    outer: OuterStep = "average"
    """The step applied to the replicas' average at a synchronisation: ``average``, the
    paper's plain average; ``nesterov``, DiLoCo's outer Nesterov step (``OuterStep``)."""

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config, with the ``outer`` step."""
        return _with_outer_step(super().periodic(), self.outer)


M = TypeVar("M", bound=SyncMethod)


class SyncMethodOptimizer(PeriodicSyncOptimizer, Generic[M]):
    """A method's optimizer: the shared machinery (``PeriodicSyncOptimizer``) run with the
    method's ``periodic()`` settings, the method's own settings in ``method``. A method with
    state of its own sets it in ``_start``.

    Args:
        optimizer: the inner optimizer over ``module``'s parameters.
        module: the replica.
        comm: the group of replicas.
        method: the settings.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, comm: Communicator, method: M
    ) -> None:
        refuse_sharded(module, method.name)
        super().__init__(optimizer, module, comm, method.periodic())
        self.module = module
        """The replica."""
        self.method: M = method
        self._start()

    def _start(self) -> None:
        """Set the method's own state, once the shared state and ``method`` are set (none by
        default)."""


#: How ``agree`` combines the ranks' values: the largest or the smallest.
AgreeOp = Literal["max", "min"]


def agree(comm: Communicator, value: int, op: AgreeOp, *, like: torch.Tensor) -> int:
    """``value`` reduced over every rank with ``op`` (``"max"`` or ``"min"``): one integer
    allreduce of one element (8 bytes per rank), exact, so every rank gets the same answer."""
    if comm.world_size == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=like.device)
    collectives.all_reduce(comm, flag, op, algo="native")
    return int(flag.item())


#: Bytes one rank hands to ``agree`` (one int64).
AGREE_BYTES = 8

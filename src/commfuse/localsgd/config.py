"""What to synchronise, how often, and the outer optimizer applied to the averaged update.

``PeriodicSyncConfig`` holds every setting of the shared machinery (``optimizer.py``). Each
method that synchronises on a clock is a ``PeriodicMethod``: a typed config with its name on
the command line, its paper's settings as its fields and defaults, and ``periodic()``, the
``PeriodicSyncConfig`` it runs (``LocalSGDConfig``, ``DiLoCoConfig``, ...; the settings they
all share are ``PeriodicSettings``). ``PeriodicSyncConfig`` is one too, the general form.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from typing_extensions import TypedDict

from commfuse.compress.base import Compressor


class PeriodicMethod(abc.ABC):
    """A local-SGD method that synchronises every H steps: its typed config."""

    #: The method's name on the command line (``--strategy diloco:H=50``).
    name: ClassVar[str]

    @abc.abstractmethod
    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config that runs the method."""


class SyncOptions(TypedDict, total=False):
    """The settings every method's function takes besides its own (``local_sgd(H=8,
    compressor=FP16())``, ``diloco(H=50, hierarchical=True, ranks_per_host=2)``): the
    ``PeriodicSettings`` fields of the same names, with the same defaults, passed through."""

    compressor: Compressor | None
    """Compresses each exchange, with its error feedback across exchanges (its messages ride
    its own ``algo``); None (the default) sends the fp32 pseudo-gradient."""
    algo: str
    """commfuse allreduce algorithm of the uncompressed exchange and of the synchronous
    gradient averages (default ``auto``)."""
    hierarchical: bool
    """Average gradients inside each host every step and the replicas across hosts every H
    steps (needs ``ranks_per_host``; default False)."""
    ranks_per_host: int
    """Ranks per host, for ``hierarchical`` (default 1)."""
    inner_lr_scale: float
    """Multiplies the inner learning rate between synchronisations (default 1.0)."""
    final_sync: bool
    """Average every replica at ``finish()``, so all ranks end with one model (default True)."""


@dataclass(kw_only=True)
class PeriodicSyncConfig(PeriodicMethod):
    """One config covers local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo: they
    differ in the period, the warm-up, the outer optimizer and the fragmenting. Each method is
    a typed config that fills it in with the paper's settings (``periodic()``):
    ``LocalSGDConfig``, ``PostLocalSGDConfig`` (``local_sgd.py``), ``SlowMoConfig``,
    ``DiLoCoConfig``, ``StreamingDiLoCoConfig`` (a file each); this is the general form."""

    name = "periodic-sync"

    H: int = 8
    """Inner steps between two synchronisations of a fragment (the period)."""
    warmup_steps: int = 0
    """Steps of fully synchronous data parallel (gradients averaged every step) before the
    periodic phase starts (post-local SGD)."""
    outer_lr: float = 1.0
    """Outer learning rate applied to the averaged pseudo-gradient (1.0 with no momentum is
    plain model averaging)."""
    outer_momentum: float = 0.0
    """Momentum of the outer SGD (SlowMo's beta, DiLoCo's 0.9)."""
    inner_lr_scale: float = 1.0
    """Multiplies the inner optimizer's learning rate in the periodic phase (not during the
    synchronous warm-up). A replica's optimizer sees 1/P of the batch that synchronous
    training's does, so its gradients are noisier; AdamW normalises them to full-size steps
    anyway, and the noise then goes into the drift that averaging removes. From a model
    trained synchronously, replicas that continue its AdamW state at the full rate see their
    loss rise for tens of steps: set it below 1 there (docs/local-sgd.md, "From a pre-trained
    model")."""
    nesterov: bool = False
    """Nesterov momentum for the outer SGD (DiLoCo)."""
    num_fragments: int = 1
    """Streaming DiLoCo: parameters split into this many fragments synchronised at staggered
    steps (fragment f at steps where (step - f H / F) is a multiple of H)."""
    overlap_steps: int = 0
    """Streaming: the exchange of a fragment runs in the background for this many inner steps
    and its result is applied then (0 = applied at once, blocking)."""
    mix_global: float = 1.0
    """Streaming: weight of the synchronised value when it is merged with the local value that
    kept training during the overlap (1.0 discards the local progress of those steps)."""
    hierarchical: bool = False
    """Average gradients inside each host every step and synchronise across hosts every H
    steps (needs the host layout: ranks_per_host)."""
    ranks_per_host: int = 1
    """Ranks per host, for ``hierarchical`` (the launcher's LOCAL_WORLD_SIZE)."""
    compressor: Compressor | None = None
    """A ``commfuse.compress`` compressor for the outer exchange (``FP16()``, ...),
    with error feedback across exchanges when it has one; its messages ride its own ``algo``.
    None: a plain allreduce of the pseudo-gradient."""
    algo: str = "auto"
    """The commfuse allreduce algorithm of the outer exchange without a compressor, and of the
    synchronous warm-up's (and hierarchical mode's) gradient averages."""
    final_sync: bool = True
    """At the end of training (``finish()``), replace every fragment whose replicas have moved
    since its last exchange by the replicas' average (an exchange in flight is applied without
    mixing), so that every rank holds the same final model. Without it a run that stops
    mid-period, and streaming DiLoCo always (its fragments sit at staggered phases and are
    mixed with local values), ends with P different replicas and rank 0's is the one
    evaluated and saved."""

    def __post_init__(self) -> None:
        if self.H < 1:
            raise ValueError(f"H must be >= 1, got {self.H}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not self.inner_lr_scale > 0:
            raise ValueError(f"inner_lr_scale must be > 0, got {self.inner_lr_scale}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {self.num_fragments}")
        if self.num_fragments > self.H:
            raise ValueError(
                f"num_fragments={self.num_fragments} > H={self.H}: "
                "each fragment needs its own step in the period"
            )
        if not 0 <= self.overlap_steps < self.H:
            raise ValueError(f"overlap_steps must be in [0, H), got {self.overlap_steps}")
        if not 0 < self.mix_global <= 1:
            raise ValueError(f"mix_global must be in (0, 1], got {self.mix_global}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host}")
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise ValueError(
                "compressor must be a commfuse.compress compressor object (e.g. "
                f"FP16()), got {type(self.compressor).__name__}"
            )

    def periodic(self) -> PeriodicSyncConfig:
        """The config itself."""
        return self


@dataclass(frozen=True, kw_only=True)
class PeriodicSettings(PeriodicMethod):
    """The settings every method that synchronises on a clock takes besides its own (the
    ``PeriodicSyncConfig`` fields of the same names, with the same defaults); the command
    line lists a method's own settings first."""

    compressor: Compressor | None = None
    """Compresses each exchange, with its error feedback across exchanges (its messages ride
    its own ``algo``); None sends the fp32 pseudo-gradient."""
    algo: str = "auto"
    """commfuse allreduce algorithm of the uncompressed exchange and of the synchronous
    gradient averages."""
    hierarchical: bool = False
    """Average gradients inside each host every step and the replicas across hosts every H
    steps (needs ``ranks_per_host``)."""
    ranks_per_host: int = 1
    """Ranks per host, for ``hierarchical``."""
    inner_lr_scale: float = 1.0
    """Multiplies the inner learning rate between synchronisations."""
    final_sync: bool = True
    """Average every replica at ``finish()``, so all ranks end with one model."""

    def __post_init__(self) -> None:
        self.periodic()  # the shared machinery's checks, as the config is built

    def shared(self) -> SyncOptions:
        """These settings, as ``PeriodicSyncConfig``'s keyword arguments."""
        return SyncOptions(
            compressor=self.compressor,
            algo=self.algo,
            hierarchical=self.hierarchical,
            ranks_per_host=self.ranks_per_host,
            inner_lr_scale=self.inner_lr_scale,
            final_sync=self.final_sync,
        )

"""Strategies: how the ranks of a data-parallel job turn local gradients into one update.

A strategy is chosen by a typed config (what a user passes, ``TrainConfig(strategy=...)``, and
what the simulator prices, ``commfuse.sim.simulate_step``):

* ``TorchDDPConfig``: torch's DistributedDataParallel, bare or with its fp16/bf16 hook;
* ``TorchPowerSGDConfig``: torch DDP with torch's own PowerSGD hook;
* ``CommfuseDPConfig``: commfuse's engine, ``commfuse.ddp.DataParallel``, uncompressed or with a
  ``commfuse.compress`` compressor (``CommfuseDPConfig(compressor=PowerSGD(rank=4))``);
* a ``commfuse.localsgd.PeriodicMethod``: local SGD, SlowMo, DiLoCo, ... (``local_sgd(H=8)``,
  ``diloco(H=50)``, ..., or their general form ``PeriodicSyncConfig``);
* a ``commfuse.localsgd.SyncMethod``: a local-SGD method that decides when or what to
  synchronise (``SelSyncConfig``, ``ADPSGDConfig``, ``PALSGDConfig``, ``DreamDDPConfig``,
  ``LocalSGDClipConfig``).
* ``commfuse.optim.OneBitAdamConfig`` / ``ZeroOneAdamConfig``: 1-bit Adam and 0/1 Adam, an
  optimizer that does the communication itself;
* a ``commfuse.decentral.DecentralMethod``: gossip (D-PSGD) or push-sum (SGP) with neighbours.

On each rank ``build_strategy(config, ctx)`` wraps the workload's model and optimizer in a
:class:`Strategy`, whose uniform step interface the training loop (``loop.py``) drives, whatever
happens underneath::

    strategy.zero_grad()
    loss = workload.loss(strategy.model, batch)   # forward through the wrapper
    strategy.backward(loss)                       # gradients; communication may start here
    strategy.sync()                               # wait for what the update needs
    strategy.optimizer_step()                     # update (+ any post-step communication)

The command line's ``--strategy NAME:key=value,...`` builds these configs (``commfuse.cli.spec``).
Adding a strategy: ``docs/design.md``, "Where each kind of change goes".
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias

import torch
from torch import nn

from commfuse.comm import Communicator
from commfuse.compress.base import Compressor

if TYPE_CHECKING:
    from commfuse.decentral import DecentralMethod
    from commfuse.localsgd import PeriodicMethod
    from commfuse.localsgd.sync_method import SyncMethod
    from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig

#: Modules that register strategy builders when imported (a new strategy adds a line here).
STRATEGY_MODULES: tuple[str, ...] = (
    "commfuse.train.torch_ddp",
    "commfuse.train.commfuse_dp",
    "commfuse.train.periodic",
)
# Optimizers that communicate themselves (1-bit Adam, 0/1 Adam).
STRATEGY_MODULES += ("commfuse.train.onebit",)
# Decentralized methods: gossip and push-sum over a topology.
STRATEGY_MODULES += ("commfuse.train.decentral",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchDDPConfig:
    """torch's ``DistributedDataParallel`` (Li et al., "PyTorch Distributed", VLDB 2020), the
    baseline of every speed-up, optionally with one of torch's 16-bit communication hooks, at
    its strongest: the knobs commfuse's engine uses for itself (``torch_ddp.py``)."""

    hook: Literal["none", "fp16", "bf16"] = "none"
    """torch's ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook`` (each bucket cast
    to 16 bits, allreduced, cast back), or none. torch's DDP accepts its bf16 hooks only in a
    build with CUDA and NCCL 2.10+ (or XPU); elsewhere ``bf16`` is refused."""
    static_graph: bool = False
    """torch DDP's static_graph (the graph and unused parameters do not change between steps)."""
    bucket_view: bool = True
    """torch DDP's gradient_as_bucket_view: gradients are views into the buckets (no copies)."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket launched, MiB (commfuse's engine and torch's default: 1)."""

    #: Resuming continues bit for bit (the hooks have no state).
    resume_caveat: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        from commfuse.train.torch_ddp import check_bf16_hooks, check_first_bucket

        if self.hook not in ("none", "fp16", "bf16"):
            raise ValueError(f"hook must be none, fp16 or bf16, got {self.hook!r}")
        check_first_bucket(self.first_bucket_cap_mb)
        if self.hook == "bf16":
            check_bf16_hooks("", "use ddp-fp16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchPowerSGDConfig:
    """torch DDP with torch's ``powerSGD_hook`` (Vogels et al., NeurIPS 2019) at its strongest:
    the same rank, warm-up and 16-bit wire as commfuse's ``powersgd`` where torch allows it (the
    names of torch's ``PowerSGDState`` in brackets)."""

    rank: int = 4
    """Rank r of the low-rank approximation (matrix_approximation_rank)."""
    warmup: int = 2
    """Steps of plain allreduce before compressing (start_powerSGD_iter; torch needs >= 2)."""
    wire: Literal["fp32", "fp16", "bf16"] = "fp32"
    """fp32, or bf16 / fp16: the hook wrapped in torch's bf16/fp16_compress_wrapper, so the
    warm-up allreduces and the factors travel in 16 bits (half the bytes)."""
    min_compression_rate: float = 1.0
    """Compress a matrix when its factors are this many times smaller (min_compression_rate;
    1 = whenever they are smaller, as commfuse's PowerSGD; torch's default is 2)."""
    error_feedback: bool = True
    """Add the last step's compression error back (use_error_feedback)."""
    warm_start: bool = True
    """Reuse last step's Q as the starting point (warm_start)."""
    epsilon: float = 0.0
    """Added to each column norm when orthogonalising (orthogonalization_epsilon)."""
    batch_same_shape: bool = False
    """Compress matrices of one shape in one batched product (batch_tensors_with_same_shape)."""
    bucket_view: bool = True
    """torch DDP's gradient_as_bucket_view (see ``TorchDDPConfig``)."""
    first_bucket_cap_mb: float | None = None
    """Cap of the first bucket launched, MiB; None: the run's ``bucket_cap_mb``, like the rest.
    Not ``ddp``'s 1 MiB: torch's hook fails on gloo with several buckets (it issues collectives
    from gloo's completion callbacks; docs/torch-hooks-on-gloo.md), so it gets one bucket
    wherever the model fits in one."""

    #: Resuming continues bit for bit: the hook's state and the order DDP built its buckets in
    #: are checkpointed, and the order is replayed before the first resumed step (torch_ddp.py).
    resume_caveat: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        from commfuse.train.torch_ddp import check_bf16_hooks, check_first_bucket

        if self.rank < 1:
            raise ValueError(f"rank must be at least 1, got {self.rank}")
        # torch's own constraint (PowerSGDState.__init__: start_powerSGD_iter > 1 when either
        # is on), checked here so that a bad config fails before any rank starts.
        if self.warmup < 2 and (self.error_feedback or self.warm_start):
            raise ValueError(
                f"warmup must be at least 2 with error feedback or warm start (torch rebuilds "
                f"DDP's buckets after the first step), got {self.warmup}"
            )
        if self.wire not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"wire must be one of fp32, fp16, bf16, got {self.wire!r}")
        if self.wire == "bf16":
            check_bf16_hooks("wire=bf16: ", "wire=fp16 wraps it in fp16 instead")
        if self.min_compression_rate <= 0 or self.epsilon < 0:
            raise ValueError("min_compression_rate must be > 0 and epsilon >= 0")
        if self.first_bucket_cap_mb is not None:
            check_first_bucket(self.first_bucket_cap_mb)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommfuseDPConfig:
    """commfuse's data-parallel engine (``commfuse.ddp.DataParallel``): buckets laid out as
    torch DDP's, launched during backward, each reduced with a commfuse collective or, with a
    ``compressor``, by that compressor (whose messages ride its own ``algo``/``gather_algo``).
    The fields are ``DataParallelConfig``'s; the bucket cap is the run's ``bucket_cap_mb``."""

    compressor: Compressor | None = None
    """Reduce every bucket with this compressor (each built strategy gets its own copy, with
    fresh state); None: a plain allreduce."""
    algo: str = "auto"
    """Allreduce algorithm of uncompressed buckets (auto = the tuner's pick per size and
    topology)."""
    merge_buckets_by_cost: bool = False
    """Re-bucket after the first step by MG-WFBP's cost model."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket launched, MiB."""
    staleness: int = 0
    """1: apply each step's averaged gradient at the next step (Pipe-SGD)."""

    def __post_init__(self) -> None:
        from commfuse.collectives.registry import check_algorithm

        check_algorithm("all_reduce", self.algo)
        if self.compressor is not None:
            if not isinstance(self.compressor, Compressor):
                raise ValueError(
                    "compressor must be a commfuse.compress compressor object (e.g. "
                    f"PowerSGD(rank=4)), got {type(self.compressor).__name__}"
                )
            check_algorithm("all_reduce", self.compressor.algo, key="algo")
            check_algorithm("all_gather", self.compressor.gather_algo, key="gather_algo")
        if self.staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1 steps, got {self.staleness}")


StrategyConfig: TypeAlias = (
    "TorchDDPConfig | TorchPowerSGDConfig | CommfuseDPConfig | PeriodicMethod"
    " | SyncMethod"  # the local-SGD methods that decide when to synchronise
    " | OneBitAdamConfig | ZeroOneAdamConfig"
    " | DecentralMethod"  # gossip and push-sum
)
"""Every strategy config: the union of the types ``commfuse train --strategy`` builds."""


def strategy_name(config: StrategyConfig) -> str:
    """The name the command line gives the config's family: ``ddp``, ``ddp-fp16``,
    ``ddp-powersgd``, ``commfuse``, a compressor's name (commfuse's engine with it), or a
    local-SGD method (``local-sgd``, ``diloco``, ...: the config's ``name``)."""
    return _name_and_settings(config)[0]


def describe_strategy(config: StrategyConfig) -> str:
    """The spec the command line would build ``config`` from, ``name[:key=value,...]`` with
    only the settings that differ from the name's defaults, so that
    ``commfuse.cli.spec.strategy_from_spec(describe_strategy(config)) == config`` and two configs
    with the same settings describe alike (a run's identity; the label of a run without one).

    A local-SGD method is described by its name and the fields it sets off its defaults
    (``diloco:H=100``); its compressor as ``compressor=NAME[:key=value]``, without the
    ``algo`` it shares with the method (the command line has room for one compressor setting
    there: more are described all the same, but the spec cannot carry them).

    Raises:
        ValueError: ``config`` is not a strategy config.
    """
    return _spec(*_name_and_settings(config))


def describe_compressor(compressor: Compressor) -> str:
    """``name[:key=value,...]`` with the settings that differ from the defaults (the spec the
    command line builds the same compressor from)."""
    return _spec(compressor.name, _changed(compressor))


def _name_and_settings(config: StrategyConfig) -> tuple[str, dict[str, Any]]:
    """The command line's name for ``config`` and the settings its spec gives."""
    from commfuse.decentral import DecentralMethod
    from commfuse.localsgd import PeriodicMethod, SyncMethod
    from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig

    if isinstance(config, DecentralMethod):
        return config.name, _changed(config)
    if isinstance(config, SyncMethod | PeriodicMethod):
        settings = _own_first(config, _changed(config))
        compressor = settings.get("compressor")
        if isinstance(compressor, Compressor):
            # The spec's compressor takes the method's algo unless it names its own.
            shared = ("algo",) if compressor.algo == getattr(config, "algo", None) else ()
            settings["compressor"] = _spec(compressor.name, _changed(compressor, skip=shared))
        if getattr(config, "hierarchical", False):
            # The spec's default is the run's host layout: say the config's own.
            settings["ranks_per_host"] = getattr(config, "ranks_per_host", 1)
        return config.name, settings
    if isinstance(config, OneBitAdamConfig):
        return "onebit-adam", _own_first(config, _changed(config))
    if isinstance(config, ZeroOneAdamConfig):
        return "zeroone-adam", _own_first(config, _changed(config))
    if isinstance(config, TorchDDPConfig):
        name = "ddp" if config.hook == "none" else f"ddp-{config.hook}"
        return name, _changed(config, skip=("hook",))
    if isinstance(config, TorchPowerSGDConfig):
        return "ddp-powersgd", _changed(config)
    if isinstance(config, CommfuseDPConfig):
        if config.compressor is None:
            return "commfuse", _changed(config, skip=("compressor",))
        engine = _changed(config, skip=("compressor", "algo"))
        return config.compressor.name, {**_changed(config.compressor), **engine}
    raise ValueError(f"not a strategy config: {type(config).__name__}")


def _changed(obj: object, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every init field of dataclass ``obj`` whose value differs from its default."""
    out = {}
    for field in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not field.init or field.name in skip:
            continue
        value = getattr(obj, field.name)
        if value != field.default:  # (MISSING equals nothing)
            out[field.name] = value
    return out


def _own_first(config: object, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with the fields ``config``'s own class declares first, then those it
    shares with other configs through a base (``ExchangeSettings``, ``ExchangeConfig``): a
    method's own settings lead its spec, as they are written."""
    own = vars(type(config)).get("__annotations__", {})
    return {
        **{k: v for k, v in settings.items() if k in own},
        **{k: v for k, v in settings.items() if k not in own},
    }


def _spec(name: str, settings: dict[str, Any]) -> str:
    """``name[:key=value,...]``."""
    extra = ",".join(f"{key}={setting_text(value)}" for key, value in settings.items())
    return f"{name}:{extra}" if extra else name


def setting_text(value: object) -> str:
    """A setting as the spec vocabulary writes it (booleans 1/0, a compressor as its spec)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, Compressor):
        return describe_compressor(value)
    return str(value)


def resume_caveat(config: StrategyConfig) -> str | None:
    """Why resuming ``config`` from a checkpoint is not bit-exact (None: it is)."""
    caveat: str | None = getattr(type(config), "resume_caveat", None)
    return caveat


def is_baseline(config: StrategyConfig) -> bool:
    """Whether ``config`` is bare torch DDP, the baseline of comparisons."""
    return isinstance(config, TorchDDPConfig) and config.hook == "none"


@dataclasses.dataclass(kw_only=True)
class StrategyContext:
    """What a builder gets on each rank."""

    module: nn.Module
    """The bare model (identical on every rank before wrapping)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over ``module``'s trainable parameters."""
    comm: Communicator
    """The ranks' communicator (its group is the data-parallel group)."""
    bucket_cap_mb: float
    """Gradient bucket size cap in MB (``--bucket-cap-mb``), for strategies that bucket."""
    seed: int
    """The run's seed (for strategies with randomness of their own)."""
    run_steps: int = 0
    """Optimizer steps the strategy takes over the whole run (from its fresh start, a resume
    included; 0: unknown), for a method whose plan spans the run (ADPSGD's budget)."""


class Strategy(abc.ABC):
    """One rank's view of a strategy; see the module docstring for the call order."""

    def __init__(self, ctx: StrategyContext) -> None:
        self.module = ctx.module
        self.optimizer = ctx.optimizer
        self.comm = ctx.comm

    @property
    @abc.abstractmethod
    def model(self) -> nn.Module:
        """What the forward pass calls (a wrapper such as DDP, or the bare module)."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def lr_groups(self) -> list[dict[str, Any]]:
        """The parameter groups whose ``lr`` a learning-rate schedule sets, in the order of
        the workload's optimizer's groups (the optimizer that takes the step)."""
        return self.optimizer.param_groups

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def sync(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Block until the gradients the update needs are complete (no-op when backward did)."""

    @abc.abstractmethod
    def optimizer_step(self) -> bool:
        """Apply the update; False when the strategy skipped it (e.g. non-finite gradients)."""

    @abc.abstractmethod
    def bytes_sent(self) -> int:
        """Bytes this rank has handed to collectives since it was built (payload, not wire)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside skip all gradient communication (used to time the compute-only step)."""
        yield

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state (compressor, error feedback, counters), per rank."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")

    def finish(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Complete communication still in flight at the end of training (an overlapped
        exchange of streaming DiLoCo), so the final parameters are the trained ones."""

    def metrics(self) -> dict[str, Any]:
        """Strategy-specific metrics for the run's record (e.g. drift between replicas)."""
        return {}

    def choices(self) -> dict[str, Any]:
        """What this rank chose that decides the run's bits beyond its configuration (bucket
        layout, algorithms, warm-up), for the run's record: two runs meant to be
        bit-identical compare them (``commfuse.testing.bits``). Plain data."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release hooks or threads."""


_Builder = Callable[[Any, StrategyContext], Strategy]
_BUILDERS: dict[type, _Builder] = {}
_loaded = False


def register_builder(config_cls: type, builder: _Builder) -> None:
    """Make ``build_strategy`` build configs of ``config_cls`` with ``builder``."""
    if config_cls in _BUILDERS:
        raise ValueError(f"{config_cls.__name__} already has a builder")
    _BUILDERS[config_cls] = builder


def build_strategy(config: StrategyConfig, ctx: StrategyContext) -> Strategy:
    """This rank's :class:`Strategy` for ``config``. A compressor in the config is copied, so
    that every strategy built owns its state (two built from one config never share it).

    Raises:
        ValueError: ``config`` is not a strategy config.
    """
    global _loaded
    if not _loaded:
        _loaded = True
        for module in STRATEGY_MODULES:
            importlib.import_module(module)
    builder = _BUILDERS.get(type(config))
    if builder is None:
        known = ", ".join(cls.__name__ for cls in _BUILDERS)
        raise ValueError(f"not a strategy config: {type(config).__name__} (use one of {known})")
    return builder(copy.deepcopy(config), ctx)


def check_strategy(config: object) -> None:
    """ValueError unless ``config`` is a strategy config (checked before any rank starts)."""
    from commfuse.decentral import DecentralMethod
    from commfuse.localsgd import PeriodicMethod, SyncMethod
    from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig

    kinds: tuple[type, ...] = (
        TorchDDPConfig,
        TorchPowerSGDConfig,
        CommfuseDPConfig,
        PeriodicMethod,  # the local-SGD methods that synchronise on a clock
        SyncMethod,  # the local-SGD methods that decide when to synchronise
        OneBitAdamConfig,
        ZeroOneAdamConfig,
        DecentralMethod,  # gossip and push-sum
    )
    if not isinstance(config, kinds):
        raise ValueError(
            f"strategy must be one of {', '.join(k.__name__ for k in kinds)} (a typed config; "
            f"the command line parses NAME:key=value specs), got {type(config).__name__}"
        )

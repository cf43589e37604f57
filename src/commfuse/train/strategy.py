"""Strategies: how the ranks of a data-parallel job turn local gradients into one update.

A strategy is a name, typed ``key=value`` options and a builder. The builder wraps a workload's
model and optimizer on one rank and returns a :class:`Strategy`, whose uniform step interface the
training loop (``loop.py``) drives, whatever happens underneath (torch DDP with or without a
communication hook, the commfuse engine with a compressor, local SGD, ...)::

    strategy.zero_grad()
    loss = workload.loss(strategy.model, batch)   # forward through the wrapper
    strategy.backward(loss)                       # gradients; communication may start here
    strategy.sync()                               # wait for what the update needs
    strategy.optimizer_step()                     # update (+ any post-step communication)

Adding a strategy (e.g. local SGD) takes one file and one call::

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class LocalSGDOptions:
        period: int = 8
        \"\"\"Optimizer steps between parameter averages.\"\"\"

    class LocalSGD(Strategy): ...   # implement the abstract methods

    register_strategy("localsgd", LocalSGDOptions, lambda opts, ctx: LocalSGD(opts, ctx),
                      help="local SGD: average parameters every `period` steps")

and the module's name added to ``STRATEGY_MODULES`` so the registry imports it. ``--strategy
localsgd:period=16`` then works in ``commfuse train`` and ``commfuse compare``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from commfuse.comm import Communicator
from commfuse.workloads.options import build_options, format_options, parse_spec

#: Modules that register strategies when imported (an engineer adding one adds a line here).
STRATEGY_MODULES: tuple[str, ...] = (
    "commfuse.train.torch_ddp",
    "commfuse.train.commfuse_dp",
    "commfuse.train.periodic",
)


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

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release hooks or threads."""


Builder = Callable[[Any, StrategyContext], Strategy]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyInfo:
    """A registered strategy."""

    name: str
    """What ``--strategy NAME`` matches."""
    options_cls: type | None
    """Keyword-only dataclass of its options; None = the raw spec goes to ``validate``."""
    builder: Builder
    """(options, ctx) -> Strategy; options is the dataclass, or the spec string if options_cls is None."""
    help: str
    """One line for listings and error messages."""
    validate: Callable[[str], None] | None = None
    """For options_cls None: raises ValueError if the full spec is bad (called before ranks start)."""
    resume_caveat: str | None = None
    """Why ``--resume`` does not continue this strategy bit for bit (None: it does, and a test
    holds it to that); ``commfuse train --resume`` warns with it."""


_REGISTRY: dict[str, StrategyInfo] = {}
#: Families resolved by a fallback (e.g. every commfuse compressor name): (known-names fn, info fn).
_FALLBACKS: list[tuple[Callable[[], list[str]], Callable[[str], StrategyInfo]]] = []
_loaded = False


def register_strategy(
    name: str,
    options_cls: type | None,
    builder: Builder,
    *,
    help: str,
    validate: Callable[[str], None] | None = None,
    resume_caveat: str | None = None,
) -> None:
    """Add a strategy to the registry (see the module docstring for an example)."""
    if name in _REGISTRY:
        raise ValueError(f"strategy {name!r} is already registered")
    _REGISTRY[name] = StrategyInfo(
        name=name,
        options_cls=options_cls,
        builder=builder,
        help=help,
        validate=validate,
        resume_caveat=resume_caveat,
    )


def register_fallback(known: Callable[[], list[str]], info: Callable[[str], StrategyInfo]) -> None:
    """A family of strategies named by another registry (e.g. one per compressor)."""
    _FALLBACKS.append((known, info))


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in STRATEGY_MODULES:
            importlib.import_module(module)


def known_strategies() -> list[str]:
    """Every name ``--strategy`` accepts, registered ones first."""
    _ensure_loaded()

    def module_order(name: str) -> int:
        module = _REGISTRY[name].builder.__module__
        return (
            STRATEGY_MODULES.index(module) if module in STRATEGY_MODULES else len(STRATEGY_MODULES)
        )

    # In STRATEGY_MODULES' order, whichever module happened to be imported first.
    names = sorted(_REGISTRY, key=module_order)
    for known, _ in _FALLBACKS:
        names += [n for n in known() if n not in names]
    return names


@dataclasses.dataclass(frozen=True)
class ParsedStrategy:
    """A validated ``--strategy`` spec."""

    spec: str
    info: StrategyInfo
    options: Any

    @property
    def label(self) -> str:
        """The spec as the user wrote it (whitespace stripped), for tables and legends."""
        return self.spec

    @property
    def canonical(self) -> str:
        """The name with only its non-default options (two specs of one run compare equal)."""
        if self.info.options_cls is None:
            return self.spec
        extra = format_options(self.options)
        return f"{self.info.name}:{extra}" if extra else self.info.name

    def build(self, ctx: StrategyContext) -> Strategy:
        return self.info.builder(self.options, ctx)


def parse_strategy(spec: str) -> ParsedStrategy:
    """Validate ``NAME[:key=value,...]``; ValueError naming the known strategies or options."""
    _ensure_loaded()
    name, raw = parse_spec(spec, what="strategy")
    info = _REGISTRY.get(name)
    if info is None:
        for known, make_info in _FALLBACKS:
            if name in known():
                info = make_info(name)
                break
    if info is None:
        raise ValueError(
            f"unknown strategy {name!r}; known: {', '.join(known_strategies())} "
            "(options go after a colon, e.g. ddp-powersgd:rank=4)"
        )
    if info.options_cls is None:
        if info.validate is not None:
            info.validate(spec.strip())
        return ParsedStrategy(spec.strip(), info, spec.strip())
    options: Any = build_options(info.options_cls, raw, where=f"strategy {name}")
    return ParsedStrategy(spec.strip(), info, options)

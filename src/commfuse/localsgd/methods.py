"""The local-SGD methods by name: the function that builds each one's config, and the way back
from a config to the method and the arguments that build it (``method_of``).

Every method fills in the same ``PeriodicSyncConfig``, so a config does not say which function
made it; ``method_of`` finds the method that rebuilds it with the fewest arguments, in the
order of ``METHODS`` (a config that none of them rebuilds is the ``periodic-sync`` form: the
config's own fields). The command line names strategies the same way (``commfuse.cli.spec``),
so a config's description (``commfuse.train.describe_strategy``) is the spec that builds it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.diloco import diloco
from commfuse.localsgd.local_sgd import local_sgd, post_local_sgd
from commfuse.localsgd.slowmo import slowmo
from commfuse.localsgd.streaming_diloco import streaming_diloco


@dataclasses.dataclass(frozen=True)
class Method:
    """One method: its function and the config field each of its own arguments sets (the
    ``SyncOptions`` it also takes are fields of the same names)."""

    build: Callable[..., PeriodicSyncConfig]
    """The function that builds the method's config (``diloco``)."""
    fields: Mapping[str, str]
    """Its own arguments -> the config fields they set (``{"H": "period_steps"}``)."""


METHODS: Mapping[str, Method] = {
    "local-sgd": Method(local_sgd, {"H": "period_steps"}),
    "post-local-sgd": Method(post_local_sgd, {"H": "period_steps", "warmup_steps": "warmup_steps"}),
    "slowmo": Method(slowmo, {"H": "period_steps", "beta": "outer_momentum", "alpha": "outer_lr"}),
    "diloco": Method(
        diloco,
        {
            "H": "period_steps",
            "outer_lr": "outer_lr",
            "outer_momentum": "outer_momentum",
            "nesterov": "nesterov",
        },
    ),
    "streaming-diloco": Method(
        streaming_diloco,
        {
            "H": "period_steps",
            "num_fragments": "num_fragments",
            "overlap_steps": "overlap_steps",
            "mix_global": "mix_global",
            "outer_lr": "outer_lr",
            "outer_momentum": "outer_momentum",
            "nesterov": "nesterov",
        },
    ),
}
"""The methods by the name the command line gives them, in the order ``method_of`` tries them."""

GENERAL = "periodic-sync"
"""The name of the general form, whose arguments are ``PeriodicSyncConfig``'s own fields."""


def method_of(config: PeriodicSyncConfig) -> tuple[str, dict[str, Any]]:
    """The method whose function rebuilds ``config`` with the fewest arguments, and those
    arguments (only the ones that differ from the function's defaults): ``diloco(H=100)``'s
    config gives ``("diloco", {"H": 100})``. A config no method rebuilds (post-local SGD's
    warm-up with an outer momentum) gives ``("periodic-sync", fields that differ from
    PeriodicSyncConfig's defaults)``, which ``PeriodicSyncConfig(**arguments)`` rebuilds.

    Raises:
        ValueError: ``config`` is not a ``PeriodicSyncConfig``.
    """
    if not isinstance(config, PeriodicSyncConfig):
        raise ValueError(f"not a PeriodicSyncConfig: {type(config).__name__}")
    best: tuple[str, dict[str, Any]] | None = None
    for name, method in METHODS.items():
        arguments = _arguments(method, config)
        if arguments is not None and (best is None or len(arguments) < len(best[1])):
            best = (name, arguments)
    if best is not None:
        return best
    default = PeriodicSyncConfig()
    return GENERAL, {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    }


def _arguments(method: Method, config: PeriodicSyncConfig) -> dict[str, Any] | None:
    """The fewest arguments with which ``method`` rebuilds ``config``, or None: the fields
    that differ from the method's defaults (where that misses, as when a default depends on
    another argument, ``diloco``'s outer step on the compressor's ``outer_recipe``, every own
    argument), then each own argument dropped that the rebuild does without."""
    base = method.build()
    names = {**method.fields, **{key: key for key in SyncOptions.__annotations__}}
    arguments = {
        arg: getattr(config, field)
        for arg, field in names.items()
        if getattr(config, field) != getattr(base, field)
    }
    if not _rebuilds(method, arguments, config):
        arguments |= {arg: getattr(config, field) for arg, field in method.fields.items()}
        if not _rebuilds(method, arguments, config):
            return None
    for arg in method.fields:
        fewer = {key: value for key, value in arguments.items() if key != arg}
        if _rebuilds(method, fewer, config):
            arguments = fewer
    return arguments


def _rebuilds(method: Method, arguments: dict[str, Any], config: PeriodicSyncConfig) -> bool:
    try:
        with warnings.catch_warnings():  # a trial build's note on the defaults it applied
            warnings.simplefilter("ignore")
            return method.build(**arguments) == config
    except ValueError:  # e.g. streaming DiLoCo's 4 fragments do not fit a period of 2
        return False

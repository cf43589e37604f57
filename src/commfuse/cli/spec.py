"""The command line's one parser: ``NAME:key=value,...`` specs turned into typed objects.

A compressor, a workload, a training strategy, a learning-rate schedule and a fault to inject
are given on the command line as specs: a name, then optionally a colon and comma-separated
``key=value`` options::

    powersgd:rank=4,warmup=10      charlm:dim=64,layers=1      diloco:H=50,outer_lr=0.7

The name picks a target, a dataclass (``PowerSGD``, ``CharLMConfig``, ``DiLoCoConfig``) or a
function with keyword parameters; the keys are the target's field or parameter names, and each
value is read by that field's type hint, with one vocabulary for every spec:

* ``bool``: ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case);
* ``int``, ``float``: Python's literals (``8``, ``0.7``, ``1e-3``);
* an ``int`` field named ``*_bytes``: a size with an optional K, M or G (``4K``, ``16M``, as
  nccl-tests writes them, ``commfuse.units.parse_size``);
* a field named ``*_mbit`` or ``*_gbit``: a link rate (``100mbit``, ``1gbit``, as ``tc``
  writes them), or a bare number in the field's unit;
* ``Literal[...]``: one of its values;
* ``X | None``: ``none``, or an X;
* a compressor (``compressor=int8``): a compressor spec of its own (one option at most, since
  commas separate the outer spec's options: ``compressor=powersgd:rank=4``).

Every mistake is a ``ValueError`` raised before any rank starts, naming the spec, the key, the
value and what is accepted (for an unknown key, the known keys; for an unknown name, the known
names). Python code never comes here: it builds the same objects directly
(``PowerSGD(rank=4)``, ``diloco(H=50)``, ``CharLMConfig(dim=64)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from commfuse.units import parse_rate_mbit, parse_size

if TYPE_CHECKING:
    from commfuse.compress import Compressor
    from commfuse.ft.config import Fault
    from commfuse.train.lr_schedule import LRSchedule
    from commfuse.train.strategy import StrategyConfig
    from commfuse.workloads import WorkloadConfig

T = TypeVar("T")

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
_BOOL_ACCEPTED = "1/0, true/false, yes/no, on/off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Spec:
    """A spec split into its parts (values still text)."""

    text: str
    """The spec as given, whitespace stripped (the label of a run in tables)."""
    name: str
    """What comes before the colon, lower-cased."""
    options: dict[str, str]
    """``key -> value`` in the order given."""


def split_spec(text: str, *, what: str = "spec") -> _Spec:
    """``"powersgd:rank=4,warmup=10"`` -> name ``powersgd``, options ``{rank: 4, warmup: 10}``.

    Raises:
        ValueError: empty text, no name, an option that is not ``key=value``, a key twice.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty {what}; expected NAME or NAME:key=value,...")
    stripped = text.strip()
    name, _, rest = stripped.partition(":")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"{what} {stripped!r} has no name before ':'")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"{what} {stripped!r}: option {item!r} is not key=value")
        if key in options:
            raise ValueError(f"{what} {stripped!r}: option {key!r} given twice")
        options[key] = value
    return _Spec(text=stripped, name=name, options=options)


# -- values ----------------------------------------------------------------------------------


def _is_compressor_type(kind: Any) -> bool:
    from commfuse.compress import Compressor

    return isinstance(kind, type) and issubclass(kind, Compressor)


def parse_value(raw: str, kind: Any, *, key: str, where: str) -> Any:
    """``raw`` read as a value of type ``kind`` for option ``key`` (see the module docstring).

    Raises:
        ValueError: ``{where}: {key}={raw!r} is not ... (accepted: ...)``.
    """

    def bad(what: str, accepted: str) -> ValueError:
        return ValueError(f"{where}: {key}={raw!r} is not {what} (accepted: {accepted})")

    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        for choice in choices:
            if raw == str(choice) or (isinstance(choice, str) and raw.lower() == choice.lower()):
                return choice
        raise bad("one of the choices", ", ".join(str(c) for c in choices))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        inner = [a for a in args if a is not type(None)]
        if type(None) in args and raw.lower() == "none":
            return None
        if len(inner) != 1:
            raise TypeError(f"{where}: option {key} has unsupported type {kind!r}")
        return parse_value(raw, inner[0], key=key, where=where)
    if kind is bool:
        low = raw.lower()
        if low in _TRUE_WORDS:
            return True
        if low in _FALSE_WORDS:
            return False
        raise bad("a boolean", _BOOL_ACCEPTED)
    if key.endswith(("_mbit", "_gbit")) and kind in (int, float):
        per_unit = 1000.0 if key.endswith("_gbit") else 1.0
        try:
            return kind(float(raw))
        except ValueError:
            pass
        try:
            return kind(parse_rate_mbit(raw) / per_unit)
        except ValueError:
            raise bad("a link rate", "a rate like 100mbit or 2.5gbit") from None
    if key.endswith("_bytes") and kind is int:
        try:
            return parse_size(raw)
        except ValueError:
            raise bad("a size", "a byte count with an optional K, M or G, like 4K or 16M") from None
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise bad("a valid int", "a whole number, like 8") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise bad("a valid float", "a number, like 0.5 or 1e-3") from None
    if kind is str:
        return raw
    if _is_compressor_type(kind):
        return compressor_from_spec(raw)
    raise TypeError(f"{where}: option {key} has unsupported type {kind!r}")


# -- targets ---------------------------------------------------------------------------------


def keys_of(target: Callable[..., Any]) -> dict[str, Any]:
    """The options ``target`` takes, with their types: a dataclass's init fields (those its
    own class declares first, then those of its bases: a method's own settings lead), or a
    function's keyword parameters (read from their type hints)."""
    hints = typing.get_type_hints(target)
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        own = vars(target).get("__annotations__", {})
        fields = [f for f in dataclasses.fields(target) if f.init]
        fields.sort(key=lambda f: f.name not in own)  # stable: each group keeps its order
        return {f.name: hints[f.name] for f in fields}
    return {
        p.name: hints[p.name]
        for p in inspect.signature(target).parameters.values()
        if p.name in hints and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _defaults_of(target: Callable[..., Any]) -> dict[str, Any]:
    """The default of each of ``keys_of(target)`` that has one (a dataclass field's default or
    factory's value, a parameter's default); keys without a default are left out."""
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(target):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out
    return {
        p.name: p.default
        for p in inspect.signature(target).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def _describe_keys(target: Callable[..., Any], *, skip: Sequence[str] = ()) -> str:
    """``target``'s keys as a spec writes them, each with its default where it has one
    (``rank=2, warmup=2, ef``): what ``--list-strategies`` shows under a name."""
    from commfuse.train.strategy import setting_text

    defaults = _defaults_of(target)
    parts = []
    for key in keys_of(target):
        if key in skip:
            continue
        value = defaults.get(key, inspect.Parameter.empty)
        if value is inspect.Parameter.empty:
            parts.append(key)
        else:  # None as the spec writes it: no compressor, no cap
            parts.append(f"{key}={'none' if value is None else setting_text(value)}")
    return ", ".join(parts)


def build(
    target: Callable[..., T],
    options: Mapping[str, str],
    *,
    where: str,
    fixed: Mapping[str, Any] | None = None,
) -> T:
    """``target(**fixed, **options)`` with every option read by its type (``parse_value``).
    ``fixed`` are values the spec's name implies; they are not keys the spec may give.

    Raises:
        ValueError: an unknown key (naming the known ones), a bad value, or the target's own
            check of the values (prefixed with ``where``).
    """
    fixed = dict(fixed or {})
    keys = {k: v for k, v in keys_of(target).items() if k not in fixed}
    unknown = [k for k in options if k not in keys]
    if unknown:
        known = ", ".join(sorted(keys)) or "(none)"
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; known keys: {known}")
    values = {k: parse_value(v, keys[k], key=k, where=where) for k, v in options.items()}
    try:
        return target(**fixed, **values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def _unknown(what: str, name: str, known: list[str], hint: str = "") -> ValueError:
    return ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}{hint}")


# -- compressors -----------------------------------------------------------------------------


def compressors() -> dict[str, type[Compressor]]:
    """Every compressor by the name a spec gives it (its ``name``), in the table's order."""
    from commfuse import compress

    classes: tuple[type[Compressor], ...] = (
        compress.NoCompression,
        compress.FP16,
        compress.BF16,
        compress.Int8,
        compress.QSGD,
        compress.TernGrad,
        compress.Sign,
        compress.EFSign,
        compress.TopK,
        compress.RandomK,
        compress.RandomBlock,
        compress.DGC,
        compress.PowerSGD,
        compress.ACPSGD,
    )
    # The outer-gradient compressors of the local-SGD family.
    classes += (compress.SparseLoCo, compress.DeMo, compress.Int4)
    return {cls.name: cls for cls in classes}


def compressor_from_spec(text: str, **defaults: Any) -> Compressor:
    """The compressor of ``"name[:key=value,...]"``, e.g. ``"powersgd:rank=4,warmup=10"``; the
    keys are its dataclass fields. ``defaults`` are typed values for fields the spec does not
    give (``algo="native"``).

    Raises:
        ValueError: an unknown name (naming the known ones), key or value.
    """
    spec = split_spec(text, what="compressor")
    table = compressors()
    if spec.name not in table:
        raise _unknown("compressor", spec.name, list(table))
    fixed = {k: v for k, v in defaults.items() if k not in spec.options}
    return build(table[spec.name], spec.options, where=f"compressor {spec.name}", fixed=fixed)


# -- workloads -------------------------------------------------------------------------------


def workload_from_spec(text: str) -> WorkloadConfig:
    """The options of workload ``"name[:key=value,...]"`` (e.g. ``charlm:dim=64,layers=1``),
    for ``commfuse.workloads.make_workload``.

    Raises:
        ValueError: an unknown name, key or value.
    """
    from commfuse.workloads import WORKLOADS

    spec = split_spec(text, what="workload")
    if spec.name not in WORKLOADS:
        raise _unknown("workload", spec.name, sorted(WORKLOADS))
    options = build(WORKLOADS[spec.name], spec.options, where=f"workload {spec.name}")
    return typing.cast("WorkloadConfig", options)


# -- learning-rate schedules ----------------------------------------------------------------


def lr_schedule_from_spec(text: str) -> LRSchedule:
    """The schedule of ``--lr-schedule "name[:key=value,...]"``: ``cosine:warmup_steps=20,
    min_ratio=0.1``, ``step:every_steps=100,gamma=0.1`` or ``constant:warmup_steps=20``
    (``commfuse.train.lr_schedule``).

    Raises:
        ValueError: an unknown name (naming the known ones), key or value.
    """
    from commfuse.train.lr_schedule import SCHEDULES

    spec = split_spec(text, what="learning-rate schedule")
    if spec.name not in SCHEDULES:
        raise _unknown("learning-rate schedule", spec.name, list(SCHEDULES))
    where = f"learning-rate schedule {spec.name}"
    return typing.cast("LRSchedule", build(SCHEDULES[spec.name], spec.options, where=where))


# -- strategies ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _StrategyName:
    """A name ``--strategy`` accepts: what it builds, and its line in ``--list-strategies``."""

    target: Callable[..., Any]
    """The config class or function whose fields or parameters are the spec's keys."""
    help: str
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Settings the name implies (``ddp-fp16``: ``hook="fp16"``)."""


#: Keys of a compressor strategy's spec that set the engine (``CommfuseDPConfig``), not the
#: compressor (``algo`` is the compressor's: its messages ride it).
_ENGINE_KEYS = ("merge_buckets_by_cost", "first_bucket_cap_mb", "staleness")


def _strategy_names() -> dict[str, _StrategyName]:
    """Every name ``--strategy`` accepts but the compressors' (``compressor_from_spec``'s
    names, which each run commfuse's engine with that compressor), in listing order."""
    from commfuse.localsgd import (
        DiLoCoConfig,
        LocalSGDConfig,
        PeriodicSyncConfig,
        PostLocalSGDConfig,
        SlowMoConfig,
        StreamingDiLoCoConfig,
    )
    from commfuse.train.strategy import CommfuseDPConfig, TorchDDPConfig, TorchPowerSGDConfig

    return {
        "ddp": _StrategyName(TorchDDPConfig, "torch DDP (the baseline)", {"hook": "none"}),
        "ddp-fp16": _StrategyName(
            TorchDDPConfig, "torch DDP + its fp16_compress_hook", {"hook": "fp16"}
        ),
        "ddp-bf16": _StrategyName(
            TorchDDPConfig, "torch DDP + its bf16_compress_hook", {"hook": "bf16"}
        ),
        "ddp-powersgd": _StrategyName(
            TorchPowerSGDConfig, "torch DDP + its powerSGD_hook (rank=4, warmup=2)"
        ),
        "commfuse": _StrategyName(
            CommfuseDPConfig,
            "commfuse DataParallel, uncompressed (algo=auto)",
            {"compressor": None},
        ),
        LocalSGDConfig.name: _StrategyName(
            LocalSGDConfig,
            "local SGD (Stich 2019): average the replicas every H steps (H=8)",
        ),
        PostLocalSGDConfig.name: _StrategyName(
            PostLocalSGDConfig,
            "post-local SGD (Lin et al. 2020): synchronous for warmup_steps, then local SGD",
        ),
        SlowMoConfig.name: _StrategyName(
            SlowMoConfig,
            "SlowMo (Wang et al. 2020): local SGD with a slow outer momentum",
        ),
        DiLoCoConfig.name: _StrategyName(
            DiLoCoConfig,
            "DiLoCo (Douillard et al. 2023): H inner steps, outer Nesterov SGD (outer_lr, "
            "outer_momentum none: 0.7, 0.9, or the compressor's paper's)",
        ),
        StreamingDiLoCoConfig.name: _StrategyName(
            StreamingDiLoCoConfig,
            "streaming DiLoCo: fragments synced at staggered steps, exchange overlapped",
        ),
        PeriodicSyncConfig.name: _StrategyName(
            PeriodicSyncConfig,
            "the methods above in general: PeriodicSyncConfig's fields as the keys",
        ),
        **_sync_method_names(),
        **_compressed_adam_names(),
        **_decentral_names(),
    }


def _decentral_names() -> dict[str, _StrategyName]:
    """The decentralized methods (``commfuse.decentral``)."""
    from commfuse.decentral import GossipConfig, PushSumConfig

    return {
        GossipConfig.name: _StrategyName(
            GossipConfig,
            "gossip (D-PSGD, Lian et al. 2017): average with the topology's neighbours every "
            "`every` steps, no all-reduce",
        ),
        PushSumConfig.name: _StrategyName(
            PushSumConfig,
            "push-sum (SGP, Assran et al. 2019): de-biased push-sum on a directed graph",
        ),
    }


def _compressed_adam_names() -> dict[str, _StrategyName]:
    """The optimizers that communicate themselves (``commfuse.optim``)."""
    from commfuse.optim import OneBitAdamConfig, ZeroOneAdamConfig

    return {
        "onebit-adam": _StrategyName(
            OneBitAdamConfig,
            "1-bit Adam (Tang et al. 2021): Adam warm-up, then frozen variance, 1-bit momentum",
        ),
        "zeroone-adam": _StrategyName(
            ZeroOneAdamConfig,
            "0/1 Adam (Lu et al. 2022): adaptive variance freezing, 1-bit syncs, local steps",
        ),
    }


def _sync_method_names() -> dict[str, _StrategyName]:
    """The local-SGD methods that decide when or what to synchronise (``SyncMethod``
    configs, their fields as the keys)."""
    from commfuse.localsgd import (
        ADPSGDConfig,
        DreamDDPConfig,
        LocalSGDClipConfig,
        PALSGDConfig,
        SelSyncConfig,
        SyncMethod,
    )

    entries: dict[type[SyncMethod], str] = {
        SelSyncConfig: "SelSync (Tyagi and Swany 2023): average on the steps whose gradient "
        "norm changed by >= threshold",
        ADPSGDConfig: "ADPSGD (Jiang and Agrawal 2020): num_syncs averages over total_steps, "
        "periods from the drift",
        PALSGDConfig: "PALSGD (Naganuma et al. 2025): DiLoCo + random pulls toward the last "
        "synchronised model",
        DreamDDPConfig: "DreamDDP (Tang et al. 2025): every layer once per H steps, a planned "
        "group per step, sent as its forward starts",
        LocalSGDClipConfig: "local SGD with clipped local steps (Liu et al., NeurIPS 2022)",
    }
    return {cls.name: _StrategyName(cls, text) for cls, text in entries.items()}


def strategy_listing() -> list[tuple[str, str]]:
    """``(name, one line)`` for every name ``--strategy`` accepts, compressors last."""
    out = [(name, entry.help) for name, entry in _strategy_names().items()]
    out += [
        (name, f"commfuse DataParallel + the {name} compressor")
        for name in compressors()
        if name != "none"
    ]
    return out


def strategy_keys(name: str) -> str:
    """The keys strategy ``name`` takes after its colon, with their defaults (``_describe_keys``;
    a compressor's own keys, then the engine's)."""
    from commfuse.train.strategy import CommfuseDPConfig

    names = _strategy_names()
    if name in names:
        entry = names[name]
        return _describe_keys(entry.target, skip=tuple(entry.fixed))
    others = [k for k in keys_of(CommfuseDPConfig) if k not in _ENGINE_KEYS]
    engine = _describe_keys(CommfuseDPConfig, skip=others)
    own = _describe_keys(compressors()[name])
    return ", ".join(part for part in (own, engine) if part)


def strategy_from_spec(text: str, *, ranks_per_host: int = 1) -> StrategyConfig:
    """The strategy config of ``"name[:key=value,...]"`` (``commfuse.train.strategy``):
    ``ddp``, ``ddp-powersgd:rank=4``, ``commfuse:algo=ring``, a compressor's name with its keys
    and the engine's ``staleness`` (``powersgd:rank=4,staleness=1``), or a local-SGD method
    with its config's fields (``diloco:H=50,outer_lr=0.7``; a ``compressor=`` there rides
    the method's ``algo`` unless it names its own). ``ranks_per_host`` is the run's host layout
    (``--ranks-per-host``), the default of a local-SGD method's own ``ranks_per_host`` (which
    ``hierarchical=1`` averages gradients within).

    Raises:
        ValueError: an unknown name (naming the known ones), key or value.
    """
    from commfuse.train.strategy import CommfuseDPConfig

    spec = split_spec(text, what="strategy")
    where = f"strategy {spec.name}"
    names = _strategy_names()
    table = compressors()
    if spec.name in names:
        entry = names[spec.name]
        options, fixed = dict(spec.options), dict(entry.fixed)
        if "compressor" in options and "algo" in keys_of(entry.target):
            algo = parse_value(options.get("algo", "auto"), str, key="algo", where=where)
            fixed["compressor"] = compressor_from_spec(options.pop("compressor"), algo=algo)
        config = build(entry.target, options, where=where, fixed=fixed)
        if getattr(config, "hierarchical", False) and "ranks_per_host" not in options:
            config = dataclasses.replace(config, ranks_per_host=ranks_per_host)
        return typing.cast("StrategyConfig", config)
    if spec.name in table and spec.name != "none":
        engine = {k: spec.options[k] for k in _ENGINE_KEYS if k in spec.options}
        own = {k: v for k, v in spec.options.items() if k not in engine}
        try:
            compressor = build(table[spec.name], own, where=where)
        except ValueError as err:
            if "unknown key" not in str(err):
                raise
            keys = sorted([*keys_of(table[spec.name]), *_ENGINE_KEYS])
            bad = next(k for k in own if k not in keys)
            raise ValueError(
                f"{where}: unknown key {bad!r}; known keys: {', '.join(keys)}"
            ) from None
        return build(CommfuseDPConfig, engine, where=where, fixed={"compressor": compressor})
    known = [name for name, _ in strategy_listing()]
    raise _unknown(
        "strategy", spec.name, known, " (options go after a colon, e.g. ddp-powersgd:rank=4)"
    )


# -- faults ----------------------------------------------------------------------------------


def fault_from_spec(text: str) -> Fault:
    """The fault of ``--chaos "name:key=value,..."``: ``kill:host=2,at_step=15,
    restart_after_s=5`` (``commfuse.ft.KillFault``: SIGKILL that host's replica group at
    that step, restart it after that many seconds, ``none`` for never), or
    ``cut:host=1,at_s=20,for_s=5`` (``commfuse.ft.CutFault``: its link down for that long),
    ``slow:host=3,link_mbit=10mbit`` (``commfuse.ft.SlowFault``: its link at that rate), or
    ``kill-every:every_s=30,seed=0`` (``commfuse.ft.KillEveryFault``: a seeded host killed
    every that many seconds and restarted).

    Raises:
        ValueError: an unknown name (naming the known ones), key or value.
    """
    from commfuse.ft.config import CutFault, KillEveryFault, KillFault, SlowFault

    table: dict[str, type[KillFault | CutFault | SlowFault | KillEveryFault]] = {
        "kill": KillFault,
        "cut": CutFault,
        "slow": SlowFault,
        "kill-every": KillEveryFault,
    }
    spec = split_spec(text, what="fault")
    if spec.name not in table:
        raise _unknown("fault", spec.name, list(table))
    return typing.cast("Fault", build(table[spec.name], spec.options, where=f"fault {spec.name}"))

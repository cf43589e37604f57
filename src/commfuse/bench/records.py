"""The records every command writes with ``--json``: one typed dataclass per kind of result.

A record names the command that wrote it in its ``kind`` field (``"bench collectives"``,
``"compare"``, ``"train"``, ...), and ``commfuse report`` looks the table up by that kind
(``commfuse.cli.report.KINDS``), never by guessing from the other keys. Each record class:

1. types the fields that make a record of its kind (``op``, ``algo``, ``bytes`` and ``time_us``
   of a collective's row), checked when it is read;
2. keeps every other key the command wrote in ``extra``, as it was written, so a column added
   later (or one that an older file lacks, printed ``-``) needs no change here;
3. writes itself with ``to_json()`` (``kind`` first, the typed fields, then ``extra``) and reads
   itself back with ``from_json()``, which names the missing or mistyped field.

Commands that write a list of records (``bench``, ``compare``, ``simulate --scale``, ...) and
those that write one (``train``, ``tune``'s profile, ``simulate``'s step, the GPU check) both go
through ``dumps``; ``load`` reads either back. Where a change goes: docs/design.md ("A report
column").
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_type_hints

#: Every kind of record, by the command that writes it.
Kind = Literal[
    "bench collectives",
    "bench fused",
    "bench fused --step",
    "bench ddp",
    "bench pipeline",
    "bench strategies",
    "bench cli",
    "compare",
    "compare --fault-tolerant",
    "train",
    "train --fault-tolerant",
    "tune",
    "tune calibration",
    "simulate",
    "simulate --scale",
    "simulate --validate",
    "gpu check",
]

KINDS: tuple[Kind, ...] = get_args(Kind)

_R = TypeVar("_R", bound="Record")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """A record of one kind: its typed fields, and ``extra``, every other key as written."""

    kind: Kind
    """The command that wrote the record (``commfuse report`` renders it as that table)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Every key the command wrote beyond the typed fields, in the order written."""

    #: Whether the command writes one record (``train``) rather than a list of them.
    single: ClassVar[bool] = False

    def to_json(self) -> dict[str, Any]:
        """The record as its command writes it: ``kind``, the typed fields, then ``extra``."""
        typed = {f.name: getattr(self, f.name) for f in _typed_fields(type(self))}
        return {"kind": self.kind, **typed, **self.extra}

    @classmethod
    def from_json(cls: type[_R], data: Mapping[str, Any]) -> _R:
        """The record ``to_json`` (or an older command) wrote.

        Raises:
            ValueError: another kind, or a typed field missing or of the wrong type (named).
        """
        kind = _kind_of_class(cls)
        if data.get("kind") != kind:
            raise ValueError(f"a {kind!r} record names kind {data.get('kind')!r}")
        hints = get_type_hints(cls)
        typed: dict[str, Any] = {}
        for f in _typed_fields(cls):
            if f.name not in data:
                raise ValueError(f"a {kind!r} record lacks its field {f.name!r}")
            if not _is_instance(data[f.name], hints[f.name]):
                raise ValueError(
                    f"a {kind!r} record's {f.name!r} is {data[f.name]!r}, not {hints[f.name]}"
                )
            typed[f.name] = data[f.name]
        extra = {k: v for k, v in data.items() if k != "kind" and k not in typed}
        return cls(**typed, extra=extra)


def _typed_fields(cls: type[Record]) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.name not in ("kind", "extra")]


def _kind_of_class(cls: type[Record]) -> Kind:
    default = {f.name: f for f in dataclasses.fields(cls)}["kind"].default
    assert isinstance(default, str), f"{cls.__name__} names no kind"
    return typing.cast(Kind, default)


def _is_instance(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (``float`` takes an int, as JSON does)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


# --- bench ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CollectiveRecord(Record):
    """``commfuse bench collectives``: one collective, algorithm and size (nccl-tests' row)."""

    kind: Literal["bench collectives"] = "bench collectives"
    op: str
    """The collective (``all_reduce``, ``broadcast``, ...)."""
    algo: str
    """The algorithm that ran (``ring``, ``native``, ``auto``, ...)."""
    bytes: int
    """Message size per rank."""
    time_us: float
    """Median time over the iterations."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FusedRecord(Record):
    """``commfuse bench fused``: one fused operator against its unfused reference."""

    kind: Literal["bench fused"] = "bench fused"
    op: str
    """The operator (``gemm_all_reduce``, ``embedding_all_to_all``, ...)."""
    shape: list[Any]
    """Its problem size, in the order the operator's ``--shape`` takes it."""
    fused_us: float
    """Median time of the fused operator."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FusedStepRecord(Record):
    """``commfuse bench fused --step``: one whole training step of a workload, fused and not."""

    kind: Literal["bench fused --step"] = "bench fused --step"
    op: str
    """The workload's step (``dlrm_step``, ``tp_transformer_step``, ...)."""
    shape: list[Any]
    """The workload's sizes."""
    fused_us: float
    """Median step time with the fused operators."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DdpRecord(Record):
    """``commfuse bench ddp``: one data-parallel engine's step against torch DDP's."""

    kind: Literal["bench ddp"] = "bench ddp"
    engine: str
    """The engine (``torch-ddp``, ``dataparallel``, ...)."""
    step_s: float
    """Median step time over the rounds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PipelineRecord(Record):
    """``commfuse bench pipeline``: one pipeline schedule's step against the sequential one."""

    kind: Literal["bench pipeline"] = "bench pipeline"
    schedule: str
    """The schedule (``1f1b``, ``zb_h1``, ...; ``sequential'`` for the A/A control)."""
    step_s: float
    """Median step time over the rounds."""
    bubble_formula: float
    """The schedule's bubble on equal stages and free links."""
    bubble_measured: float
    """The idle share of the ranks' time in a traced step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _StrategiesRecord(Record):
    """``commfuse bench strategies``: one strategy's step, timed in balanced rounds."""

    kind: Literal["bench strategies"] = "bench strategies"
    strategy: str
    """The strategy as given on the command line."""
    step_s: float
    """Median step time over the rounds."""
    ratio_to_first: float
    """Its step time over the first strategy's, the median of the rounds' ratios."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CliLatencyRecord(Record):
    """``tests/scripts/cli_latency.py``: one command's wall time in one source tree."""

    kind: Literal["bench cli"] = "bench cli"
    command: str
    """The ``commfuse`` arguments timed."""
    tree: str
    """Which source tree ran them."""
    wall_s: float
    """Median wall time over the rounds."""


# --- runs -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CompareRecord(Record):
    """``commfuse compare``: one strategy's training run (losses, bytes, time per step)."""

    kind: Literal["compare"] = "compare"
    strategy: str
    """The strategy's label."""
    step_time_s: float
    """Median time per step over the rounds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CompareFaultTolerantRecord(Record):
    """``commfuse compare --fault-tolerant``: one job on torchft (goodput, recovery times)."""

    kind: Literal["compare --fault-tolerant"] = "compare --fault-tolerant"
    strategy: str
    """The job's label."""
    mode: str
    """How it ran: ``plain`` (no torchft), ``ft`` or ``ft+faults``."""
    goodput_ratio: float
    """Its committed steps per second over the reference job's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TrainRecord(Record):
    """``commfuse train``: the run's metrics (one record)."""

    single: ClassVar[bool] = True
    kind: Literal["train"] = "train"
    strategy: str
    """The strategy's label."""
    step_time_s: float
    """Median time per step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TrainFaultTolerantRecord(Record):
    """``commfuse train --fault-tolerant``: the torchft run's metrics and faults (one record)."""

    single: ClassVar[bool] = True
    kind: Literal["train --fault-tolerant"] = "train --fault-tolerant"
    strategy: str
    """The strategy's label."""
    mode: str
    """How replicas synchronise: ``ddp`` (every step) or ``periodic``."""


# --- tune and simulate ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneProfileRecord(Record):
    """``commfuse tune --save-profile``: the tuner's profile (one record; ``Profile.from_json``
    reads it back)."""

    single: ClassVar[bool] = True
    kind: Literal["tune"] = "tune"
    intra: dict[str, Any]
    """The link inside a host: ``alpha_s``, ``beta_s_per_byte``, ``gamma_s_per_byte``."""
    inter: dict[str, Any]
    """The link between hosts, the same fields."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TuneCalibrationRecord(Record):
    """``commfuse tune --json``: one calibration point, measured against the model."""

    kind: Literal["tune calibration"] = "tune calibration"
    collective: str
    """The collective calibrated."""
    algo: str
    """Its algorithm."""
    bytes: int
    """Message size."""
    measured_s: float
    """Measured time."""
    model_s: float
    """The calibrated model's time."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _SimulateRecord(Record):
    """``commfuse simulate``: one predicted step and its breakdown (one record)."""

    single: ClassVar[bool] = True
    kind: Literal["simulate"] = "simulate"
    ranks: int
    """Ranks simulated."""
    step_us: float
    """Predicted step time."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ScaleRecord(Record):
    """``commfuse simulate --scale``: one series' predicted step at one rank count."""

    kind: Literal["simulate --scale"] = "simulate --scale"
    ranks: int
    """Ranks simulated."""
    series: str
    """The algorithm or plan."""
    step_us: float
    """Predicted step (or collective) time."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ValidationRecord(Record):
    """``commfuse simulate --validate``: one configuration's predicted and measured time."""

    kind: Literal["simulate --validate"] = "simulate --validate"
    config: str
    """The configuration, described."""
    predicted_us: float
    """The calibrated simulator's prediction."""
    measured_us: float
    """The time measured on the emulated cluster."""
    error: float
    """``predicted / measured - 1``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GpuCheckRecord(Record):
    """``benchmarks/device/gpu_check.sh``: every check on one GPU (one record)."""

    single: ClassVar[bool] = True
    kind: Literal["gpu check"] = "gpu check"
    device: str
    """The device checked (``cuda:0``)."""
    backend: str
    """The process group's backend."""
    checks: list[Any]
    """One object per check: its name, ``ok`` and what it measured."""
    failed: list[Any]
    """The names of the checks that failed."""


#: The record class of every kind.
RECORDS: dict[Kind, type[Record]] = {
    _kind_of_class(cls): cls
    for cls in (
        _CollectiveRecord,
        _FusedRecord,
        _FusedStepRecord,
        _DdpRecord,
        _PipelineRecord,
        _StrategiesRecord,
        _CliLatencyRecord,
        _CompareRecord,
        _CompareFaultTolerantRecord,
        _TrainRecord,
        _TrainFaultTolerantRecord,
        TuneProfileRecord,
        _TuneCalibrationRecord,
        _SimulateRecord,
        _ScaleRecord,
        _ValidationRecord,
        _GpuCheckRecord,
    )
}
assert set(RECORDS) == set(KINDS), "every kind has its record class"


def kind_named(data: Any) -> Kind:
    """The kind the records of ``data`` (a parsed ``--json`` file) name.

    Raises:
        ValueError: no ``kind``, a kind no command writes, or records of several kinds.
    """
    rows = data if isinstance(data, list) else [data]
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        raise ValueError(
            "not a commfuse result: expected a --json file of a commfuse command (a list of "
            "records, or one record), each naming its kind"
        )
    named = {r.get("kind") for r in rows}
    if len(named) > 1:
        raise ValueError(f"records of several kinds in one file: {sorted(map(str, named))}")
    (kind,) = named
    if kind not in RECORDS:
        said = "no kind" if kind is None else f"kind {kind!r}"
        raise ValueError(
            f"not a commfuse result: its records name {said}; the kinds are "
            f"{', '.join(map(repr, KINDS))} (a file written before records named their kind: "
            'add "kind": "<command>" to each record)'
        )
    return typing.cast(Kind, kind)


def load(data: Any) -> list[Record]:
    """The typed records of a parsed ``--json`` file (one record: a list of one).

    Raises:
        ValueError: as ``kind_named``; a list where the kind writes one record, or the reverse;
            a record that lacks a typed field, or has one of the wrong type.
    """
    kind = kind_named(data)
    cls = RECORDS[kind]
    if cls.single == isinstance(data, list):
        shape = "one record" if cls.single else "a list of records"
        raise ValueError(f"a {kind!r} result is {shape}")
    return [cls.from_json(r) for r in (data if isinstance(data, list) else [data])]


def of_kind(kind: Kind, rows: Sequence[Mapping[str, Any]]) -> list[Record]:
    """Typed records of ``kind`` from the plain rows a runner built (a ``kind`` a row already
    names must be that one).

    Raises:
        ValueError: a row of another kind, or one that lacks a typed field.
    """
    return [RECORDS[kind].from_json({**row, "kind": row.get("kind", kind)}) for row in rows]


def dumps(records: Record | Sequence[Record]) -> str:
    """The ``--json`` text of one record or a list of them (indented, ending in a newline)."""
    if isinstance(records, Record):
        return json.dumps(records.to_json(), indent=1) + "\n"
    return json.dumps([r.to_json() for r in records], indent=1) + "\n"


def to_text(kind: Kind, rows: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
    """``dumps`` of the rows a runner built as records of ``kind`` (one row where ``kind``
    writes one record).

    Raises:
        ValueError: as ``of_kind``.
    """
    if isinstance(rows, Mapping):
        return dumps(of_kind(kind, [rows])[0])
    return dumps(of_kind(kind, rows))

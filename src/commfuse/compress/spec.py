"""``make_compressor("name:key=value,...")``: the registry of compressors and the spec parser.

The keys of a spec are the compressor's dataclass settings (``ratio``, ``levels``, ``rank``,
``warmup``, ``momentum``, ``chunk_numel``, ``ef``, ``seed``); values are parsed by the field's
type (``ef=1``/``ef=true``). ``algo`` and ``gather_algo`` (the commfuse collective algorithms)
are given as keyword arguments, not in the spec, so one spec names one compression scheme.
"""

from __future__ import annotations

import dataclasses
import typing

from commfuse.compress.acpsgd import ACPSGD
from commfuse.compress.base import Compressor
from commfuse.compress.cast import BF16, FP16, NoCompression
from commfuse.compress.dgc import DGC
from commfuse.compress.int8 import Int8
from commfuse.compress.powersgd import PowerSGD
from commfuse.compress.quantize import QSGD, TernGrad
from commfuse.compress.sign import EFSign, Sign
from commfuse.compress.sparse import RandomBlock, RandomK, TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        NoCompression,
        FP16,
        BF16,
        Int8,
        QSGD,
        TernGrad,
        Sign,
        EFSign,
        TopK,
        RandomK,
        RandomBlock,
        DGC,
        PowerSGD,
        ACPSGD,
    )
}
_NOT_IN_SPEC = ("algo", "gather_algo")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def spec_keys(cls: type[Compressor]) -> dict[str, type]:
    """The settings a spec may give for ``cls``, with their types."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.init and f.name not in _NOT_IN_SPEC
    }


def _parse_value(name: str, key: str, kind: type, text: str) -> object:
    if typing.get_origin(kind) is typing.Literal:
        if text in typing.get_args(kind):
            return text
        choices = ", ".join(map(str, typing.get_args(kind)))
        raise ValueError(f"{name}: {key} must be one of {choices}, got {text!r}")
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{name}: {key} must be 0 or 1 (or true/false), got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: {key} must be {kind.__name__}, got {text!r}") from None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"topk:ratio=0.01,ef=1"`` -> ``("topk", {"ratio": "0.01", "ef": "1"})``."""
    name, _, rest = spec.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"compressor spec {spec!r}: {item!r} is not key=value")
        if key.strip() in options:
            raise ValueError(f"compressor spec {spec!r}: {key.strip()!r} given twice")
        options[key.strip()] = value.strip()
    return name.strip().lower(), options


def make_compressor(spec: str, *, algo: str = "auto", gather_algo: str = "auto") -> Compressor:
    """A compressor from ``"name[:key=value,...]"``, e.g. ``"powersgd:rank=4,warmup=10"``.

    ``algo`` is the commfuse allreduce algorithm of allreduce-compatible compressors,
    ``gather_algo`` the allgather algorithm of allgather-based ones. Raises ValueError naming
    the known compressors or the known keys of the one asked for."""
    name, options = parse_spec(spec)
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown compressor {name!r} in {spec!r}: use one of {', '.join(COMPRESSORS)}"
        )
    keys = spec_keys(cls)
    values: dict[str, object] = {}
    for key, text in options.items():
        if key not in keys:
            raise ValueError(f"{name}: unknown key {key!r}; known keys: {', '.join(sorted(keys))}")
        values[key] = _parse_value(name, key, keys[key], text)
    return cls(algo=algo, gather_algo=gather_algo, **values)  # type: ignore[arg-type]

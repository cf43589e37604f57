"""``NAME:key=value,key=value`` specs with typed options, shared by ``--workload`` and ``--strategy``.

Each registered item (a workload, a strategy) declares its options as a keyword-only dataclass;
:func:`parse_spec` splits the text and :func:`build_options` turns the strings into that
dataclass, converting each value to the field's type (int, float, bool, str) and naming the
known keys when one is unknown, so a typo fails before any rank starts.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

OptionsT = TypeVar("OptionsT")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_spec(text: str, *, what: str = "spec") -> tuple[str, dict[str, str]]:
    """``"powersgd:rank=4,warmup=10"`` -> ``("powersgd", {"rank": "4", "warmup": "10"})``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty {what}; expected NAME or NAME:key=value,...")
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"{what} {text!r} has no name before ':'")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"{what} {text!r}: option {item!r} is not key=value")
        if key in options:
            raise ValueError(f"{what} {text!r}: option {key!r} given twice")
        options[key] = value
    return name, options


def _convert(raw: str, kind: Any, *, key: str, where: str) -> Any:
    if kind is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{where}: {key}={raw!r} is not a boolean (true/false)")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{where}: {key}={raw!r} is not a valid {kind.__name__}") from None
    args = typing.get_args(kind)
    if type(None) in args:  # Optional[X]: "none" means None
        if raw.lower() == "none":
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(raw, inner[0], key=key, where=where)
    raise TypeError(f"{where}: option {key} has unsupported type {kind!r}")


def build_options(cls: type[OptionsT], raw: dict[str, str], *, where: str) -> OptionsT:
    """Instantiate the options dataclass ``cls`` from string values (ValueError on bad input)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "(none)"
        raise ValueError(f"{where}: unknown option(s) {', '.join(unknown)}; known: {known}")
    values = {key: _convert(val, hints[key], key=key, where=where) for key, val in raw.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def format_options(options: object) -> str:
    """The options that differ from their defaults, as ``key=value,...`` (for names in tables)."""
    out = []
    for field in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        out.append(f"{field.name}={value}")
    return ",".join(out)

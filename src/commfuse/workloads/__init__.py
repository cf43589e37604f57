"""Models and real data sets, offline: what ``commfuse train --workload NAME`` trains.

``charlm``: a character Transformer on the Python standard library's own source files;
``digits``: an MLP on scikit-learn's digits. Nothing is ever downloaded.

To add a workload: subclass :class:`Workload` in its own file, give it an options dataclass
(keyword-only, one docstring per field), and add one line to ``WORKLOADS`` below.

The model-parallel workloads are not in ``WORKLOADS``: ``dlrm`` (sharded embedding tables),
``moe`` (sharded experts) and ``tp_transformer`` (Megatron tensor parallelism) need the
communicator to build their model, shard it, and own their gradient communication, which the
data-parallel strategies of ``commfuse train`` would duplicate. ``commfuse bench fused --step``
and their tests drive them.
"""

from __future__ import annotations

import importlib
from typing import Any

from commfuse.workloads.base import Workload, batch_generator
from commfuse.workloads.options import build_options, format_options, parse_spec

#: name -> ("module:WorkloadClass", "module:OptionsClass"); imported on use.
WORKLOADS: dict[str, tuple[str, str]] = {
    "charlm": ("commfuse.workloads.charlm:CharLM", "commfuse.workloads.charlm:CharLMOptions"),
    "digits": ("commfuse.workloads.digits:Digits", "commfuse.workloads.digits:DigitsOptions"),
}


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def parse_workload(spec: str) -> tuple[str, object]:
    """Validate ``NAME[:key=value,...]`` and return (name, options); ValueError if bad."""
    name, raw = parse_spec(spec, what="workload")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    options = build_options(_load(WORKLOADS[name][1]), raw, where=f"workload {name}")
    return name, options


def make_workload(spec: str) -> Workload:
    """The workload for ``NAME[:key=value,...]`` (e.g. ``charlm:dim=64,layers=1``)."""
    name, options = parse_workload(spec)
    workload: Workload = _load(WORKLOADS[name][0])(options)
    return workload


__all__ = [
    "WORKLOADS",
    "Workload",
    "batch_generator",
    "format_options",
    "make_workload",
    "parse_spec",
    "parse_workload",
]

"""Models and real data sets, offline: what ``commfuse train --workload NAME`` trains.

``charlm``: a character Transformer on the Python standard library's own source files;
``digits``: an MLP on scikit-learn's digits. Nothing is ever downloaded.

A workload is chosen by its options, a typed dataclass (``CharLMConfig(dim=64, layers=1)``,
``DigitsConfig()``); ``make_workload(options, device=...)`` builds it on that device. To add a workload: subclass
:class:`Workload` in its own file, give it a config dataclass (keyword-only, one docstring per
field), and add one line to ``WORKLOADS`` below (its command-line name and config class) and
one to ``_CLASSES``.

The model-parallel workloads are not in ``WORKLOADS``: ``dlrm`` (sharded embedding tables),
``moe`` (sharded experts) and ``tp_transformer`` (Megatron tensor parallelism) need the
communicator to build their model, shard it, and own their gradient communication, which the
data-parallel strategies of ``commfuse train`` would duplicate. ``commfuse bench fused --step``
and their tests drive them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeAlias

import torch

from commfuse.workloads.base import Workload, batch_generator
from commfuse.workloads.charlm import CharLM, CharLMConfig
from commfuse.workloads.digits import Digits, DigitsConfig

WorkloadConfig: TypeAlias = CharLMConfig | DigitsConfig
"""The options of a workload ``commfuse train`` can run: one of the config classes."""

WORKLOADS: dict[str, type[WorkloadConfig]] = {"charlm": CharLMConfig, "digits": DigitsConfig}
"""Command-line name -> config class (``--workload charlm:dim=64``)."""
_CLASSES: dict[type, Callable[..., Workload]] = {
    CharLMConfig: CharLM,
    DigitsConfig: Digits,
}


def check_workload(options: object) -> None:
    """ValueError unless ``options`` are a workload's options (checked before any rank starts)."""
    if type(options) not in _CLASSES:
        known = ", ".join(cls.__name__ for cls in _CLASSES)
        raise ValueError(
            f"workload must be one of {known} (typed options; the command line parses "
            f"NAME:key=value specs), got {type(options).__name__}"
        )


def make_workload(options: WorkloadConfig, *, device: torch.device) -> Workload:
    """The workload of ``options`` (e.g. ``CharLMConfig(dim=64, layers=1)``) on ``device``
    (the rank's ``Communicator.device``): its model, optimizer state and batches live there.

    Raises:
        ValueError: ``options`` are not a workload's options.
    """
    check_workload(options)
    return _CLASSES[type(options)](options, device=device)


def describe_workload(options: WorkloadConfig) -> str:
    """``name[:key=value,...]`` with the options that differ from their defaults (``charlm``,
    ``charlm:dim=64,layers=1``): a run's name in tables and its identity in checkpoints."""
    check_workload(options)
    name = next(n for n, cls in WORKLOADS.items() if cls is type(options))
    changed = [
        f"{f.name}={getattr(options, f.name)}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != f.default
    ]
    return f"{name}:{','.join(changed)}" if changed else name


__all__ = [
    "WORKLOADS",
    "CharLMConfig",
    "DigitsConfig",
    "Workload",
    "WorkloadConfig",
    "batch_generator",
    "check_workload",
    "describe_workload",
    "make_workload",
]

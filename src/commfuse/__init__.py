"""commfuse: spend less time communicating in distributed PyTorch training.

Layers (see DESIGN.md): ``cluster`` (where ranks run), ``comm`` (the transport every
algorithm uses), ``collectives``, ``fused``/``compress``, ``ddp``/``localsgd``, ``sim``.
"""

__version__ = "0.1.0"

from typing import Any

#: Names importable from the top level, loaded on first use (importing commfuse stays cheap:
#: the CLI and the rank processes import it before torch is needed).
_LAZY = {
    "DataParallel": "commfuse.ddp",
    "DataParallelConfig": "commfuse.ddp",
    "PeriodicSyncOptimizer": "commfuse.localsgd",
}
_LAZY_MODULES = ("hooks", "collectives", "comm", "compress", "ddp", "fused", "localsgd", "sim")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"commfuse.{name}")
    raise AttributeError(f"module 'commfuse' has no attribute {name!r}")

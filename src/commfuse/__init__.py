"""commfuse: spend less time communicating in distributed PyTorch training.

Layers (see ``docs/design.md``): ``cluster`` (where ranks run), ``comm`` (the transport every
algorithm uses), ``collectives``, ``fused``/``compress``, ``ddp``/``localsgd``, ``sim``.
"""

from commfuse.lazy import attach

__version__ = "0.1.0"

#: Submodules reachable as attributes of the package, loaded on first use.
_SUBMODULES = ("hooks", "collectives", "comm", "compress", "ddp", "fused", "localsgd", "sim")

# Names importable from the top level, loaded on first use: the command and the rank processes
# import commfuse before torch is needed, and the simulator never needs it.
__getattr__, __dir__ = attach(
    __name__,
    {
        "DataParallel": "commfuse.ddp",
        "DataParallelConfig": "commfuse.ddp",
        "PeriodicSyncOptimizer": "commfuse.localsgd",
        **{name: f"commfuse.{name}" for name in _SUBMODULES},
    },
)

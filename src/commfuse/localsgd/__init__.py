"""Communicating less often: local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo.

``PeriodicSyncOptimizer`` (``optimizer.py``) wraps any inner optimizer and runs the config
(``PeriodicSyncConfig``, ``config.py``) that one function per method builds: ``local_sgd`` and
``post_local_sgd`` (``local_sgd.py``), ``slowmo`` (``slowmo.py``), ``diloco`` (``diloco.py``),
``streaming_diloco`` (``streaming_diloco.py``), each with its own arguments and the
settings they all take (``SyncOptions``). The outer step is in ``outer.py`` and the
fragmenting of streaming DiLoCo in ``fragments.py``.
"""

from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.diloco import diloco
from commfuse.localsgd.local_sgd import local_sgd, post_local_sgd
from commfuse.localsgd.methods import GENERAL, METHODS, Method, method_of
from commfuse.localsgd.optimizer import PeriodicSyncOptimizer, SyncRecord
from commfuse.localsgd.slowmo import slowmo
from commfuse.localsgd.streaming_diloco import streaming_diloco

__all__ = [
    "GENERAL",
    "METHODS",
    "Method",
    "PeriodicSyncConfig",
    "PeriodicSyncOptimizer",
    "SyncOptions",
    "SyncRecord",
    "diloco",
    "local_sgd",
    "method_of",
    "post_local_sgd",
    "slowmo",
    "streaming_diloco",
]

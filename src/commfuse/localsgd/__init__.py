"""Communicating less often: local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo.

``PeriodicSyncOptimizer`` (``optimizer.py``) wraps any inner optimizer and runs the config
(``PeriodicSyncConfig``, ``config.py``) that one function per method builds: ``local_sgd`` and
``post_local_sgd`` (``local_sgd.py``), ``slowmo`` (``slowmo.py``), ``diloco`` (``diloco.py``),
``streaming_diloco`` (``streaming_diloco.py``), each with its own arguments and the
settings they all take (``SyncOptions``). The outer step is in ``outer.py`` and the
fragmenting of streaming DiLoCo in ``fragments.py``.

The methods that decide when or what to synchronise (``sync_method.py``) have a typed config
each (a ``SyncMethod``), built into their own optimizer (a ``SyncMethodOptimizer``): ``SelSyncConfig`` (``selsync.py``), ``ADPSGDConfig``
(``adpsgd.py``), ``PALSGDConfig`` (``palsgd.py``), ``DreamDDPConfig`` (``dreamddp.py``, its
layer plan in ``layer_schedule.py``) and ``LocalSGDClipConfig`` (``localsgd_clip.py``).
"""

from commfuse.localsgd.adpsgd import ADPSGDConfig, ADPSGDOptimizer
from commfuse.localsgd.config import PeriodicSyncConfig, SyncOptions
from commfuse.localsgd.diloco import diloco
from commfuse.localsgd.dreamddp import DreamDDPConfig, DreamDDPOptimizer
from commfuse.localsgd.local_sgd import local_sgd, post_local_sgd
from commfuse.localsgd.localsgd_clip import LocalSGDClipConfig, LocalSGDClipOptimizer
from commfuse.localsgd.methods import GENERAL, METHODS, Method, method_of
from commfuse.localsgd.optimizer import PeriodicSyncOptimizer, SyncRecord
from commfuse.localsgd.palsgd import PALSGDConfig, PALSGDOptimizer
from commfuse.localsgd.selsync import SelSyncConfig, SelSyncOptimizer
from commfuse.localsgd.slowmo import slowmo
from commfuse.localsgd.streaming_diloco import streaming_diloco
from commfuse.localsgd.sync_method import SyncMethod, SyncMethodOptimizer

__all__ = [
    "GENERAL",
    "METHODS",
    "ADPSGDConfig",
    "ADPSGDOptimizer",
    "DreamDDPConfig",
    "DreamDDPOptimizer",
    "LocalSGDClipConfig",
    "LocalSGDClipOptimizer",
    "Method",
    "PALSGDConfig",
    "PALSGDOptimizer",
    "PeriodicSyncConfig",
    "PeriodicSyncOptimizer",
    "SelSyncConfig",
    "SelSyncOptimizer",
    "SyncMethod",
    "SyncMethodOptimizer",
    "SyncOptions",
    "SyncRecord",
    "diloco",
    "local_sgd",
    "method_of",
    "post_local_sgd",
    "slowmo",
    "streaming_diloco",
]

"""Communicating less often: local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo.

Every method is a typed config with its name on the command line. Those that synchronise on a
clock are ``PeriodicMethod``s (``config.py``): ``LocalSGDConfig`` and ``PostLocalSGDConfig``
(``local_sgd.py``), ``SlowMoConfig`` (``slowmo.py``), ``DiLoCoConfig`` (``diloco.py``),
``StreamingDiLoCoConfig`` (``streaming_diloco.py``), each built by its function with the
paper's settings (``local_sgd``, ``post_local_sgd``, ``slowmo``, ``diloco``,
``streaming_diloco``), and ``PeriodicSyncConfig``, the general form whose fields every other
fills in (``periodic()``). ``PeriodicSyncOptimizer`` (``optimizer.py``) wraps any inner
optimizer and runs it; the outer step is in ``outer.py`` and the fragmenting of streaming
DiLoCo in ``fragments.py``.

The methods that decide when or what to synchronise (``sync_method.py``) have a typed config
each (a ``SyncMethod``), built into their own optimizer (a ``SyncMethodOptimizer``):
``SelSyncConfig`` (``selsync.py``), ``ADPSGDConfig`` (``adpsgd.py``), ``PALSGDConfig``
(``palsgd.py``), ``DreamDDPConfig`` (``dreamddp.py``, its layer plan in ``layer_schedule.py``)
and ``LocalSGDClipConfig`` (``localsgd_clip.py``).
"""

from commfuse.localsgd.adpsgd import ADPSGDConfig, ADPSGDOptimizer
from commfuse.localsgd.config import (
    PeriodicMethod,
    PeriodicSettings,
    PeriodicSyncConfig,
    SyncOptions,
)
from commfuse.localsgd.diloco import DiLoCoConfig, diloco
from commfuse.localsgd.dreamddp import DreamDDPConfig, DreamDDPOptimizer
from commfuse.localsgd.local_sgd import (
    LocalSGDConfig,
    PostLocalSGDConfig,
    local_sgd,
    post_local_sgd,
)
from commfuse.localsgd.localsgd_clip import LocalSGDClipConfig, LocalSGDClipOptimizer
from commfuse.localsgd.optimizer import PeriodicSyncOptimizer, SyncRecord
from commfuse.localsgd.palsgd import PALSGDConfig, PALSGDOptimizer
from commfuse.localsgd.selsync import SelSyncConfig, SelSyncOptimizer
from commfuse.localsgd.slowmo import SlowMoConfig, slowmo
from commfuse.localsgd.streaming_diloco import StreamingDiLoCoConfig, streaming_diloco
from commfuse.localsgd.sync_method import SyncMethod, SyncMethodOptimizer

__all__ = [
    "ADPSGDConfig",
    "ADPSGDOptimizer",
    "DiLoCoConfig",
    "DreamDDPConfig",
    "DreamDDPOptimizer",
    "LocalSGDClipConfig",
    "LocalSGDClipOptimizer",
    "LocalSGDConfig",
    "PALSGDConfig",
    "PALSGDOptimizer",
    "PeriodicMethod",
    "PeriodicSettings",
    "PeriodicSyncConfig",
    "PeriodicSyncOptimizer",
    "PostLocalSGDConfig",
    "SelSyncConfig",
    "SelSyncOptimizer",
    "SlowMoConfig",
    "StreamingDiLoCoConfig",
    "SyncMethod",
    "SyncMethodOptimizer",
    "SyncOptions",
    "SyncRecord",
    "diloco",
    "local_sgd",
    "post_local_sgd",
    "slowmo",
    "streaming_diloco",
]

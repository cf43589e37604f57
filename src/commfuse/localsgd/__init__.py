"""Communicating less often: local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo.

``PeriodicSyncOptimizer`` (``optimizer.py``) wraps any inner optimizer; ``config_from_preset``
builds the config of a named strategy (``config.py``); the outer step is in ``outer.py`` and the
fragmenting of streaming DiLoCo in ``fragments.py``.
"""

from commfuse.localsgd.config import PRESETS, PeriodicSyncConfig, config_from_preset
from commfuse.localsgd.optimizer import PeriodicSyncOptimizer, SyncRecord

__all__ = [
    "PRESETS",
    "PeriodicSyncConfig",
    "PeriodicSyncOptimizer",
    "SyncRecord",
    "config_from_preset",
]

"""Helpers for commfuse's own tests and for users testing code built on it.

Nothing in the package imports this module.
"""

from commfuse.testing.pool import RankPool, close_pools, get_pool
from commfuse.testing.stress import Stress, StressConfig, under_stress

__all__ = ["RankPool", "Stress", "StressConfig", "close_pools", "get_pool", "under_stress"]

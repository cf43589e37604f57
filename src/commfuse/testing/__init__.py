"""Helpers for commfuse's own tests and for users testing code built on it.

Nothing in the package imports this module.
"""

from commfuse.testing.pool import RankPool, close_pools, get_pool

__all__ = ["RankPool", "close_pools", "get_pool"]

"""Helpers for commfuse's own tests and for users testing code built on it.

Nothing in the package imports this module.
"""

from typing import Any

from commfuse.testing.pool import RankPool, close_pools, get_pool

__all__ = ["RankPool", "Stress", "StressConfig", "close_pools", "get_pool", "under_stress"]


def __getattr__(name: str) -> Any:
    # ``stress`` on first use: ``python -m commfuse.testing.stress`` runs that module as
    # __main__, which an import of it here would have loaded once already.
    if name in ("Stress", "StressConfig", "under_stress"):
        from commfuse.testing import stress

        return getattr(stress, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

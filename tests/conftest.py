"""Shared fixtures: persistent rank pools, one per world size, for the whole test session."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from commfuse.testing import RankPool, close_pools, get_pool


@pytest.fixture(scope="session")
def pool() -> Iterator[Callable[[int], RankPool]]:
    """``pool(n)`` is the session's pool of n ranks (started on first use, closed at the end)."""
    yield get_pool
    close_pools()

"""Shared fixtures and markers: persistent rank pools, one per world size, for the whole test
session; ``stressed``, the machine loaded for one test (``commfuse.testing.stress``); and the
``netlab`` marker, which needs the emulated network.

A test marked ``netlab`` builds network namespaces, veth pairs and ``tbf`` qdiscs, which needs
root. Where the network cannot be built it is skipped with the reason, except under ``CI=true``
(CI runs as root): there it FAILS, so the emulated-network tests (the multi-node torchrun run,
the link shaping) can never pass CI by silently not running.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from commfuse.testing import RankPool, close_pools, get_pool
from commfuse.testing.stress import Stress, under_stress


def in_ci() -> bool:
    """Whether this run is CI (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netlab") is None:
        return
    from commfuse.cluster.netlab import netlab_unavailable_reason

    reason = netlab_unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true, but the emulated network cannot be built: {reason}", pytrace=False)
    pytest.skip(f"netlab unavailable: {reason}")


@pytest.fixture
def stressed() -> Iterator[Stress]:
    """The machine loaded for the test's duration (``commfuse.testing.stress``: two busy
    processes per core, 256 MiB held and touched), stopped when the test ends."""
    with under_stress(memory_mb=256) as load:
        yield load


@pytest.fixture(scope="session")
def pool() -> Iterator[Callable[[int], RankPool]]:
    """``pool(n)`` is the session's pool of n ranks (started on first use, closed at the end)."""
    yield get_pool
    close_pools()

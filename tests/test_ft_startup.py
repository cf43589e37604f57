"""A replica is known to the lighthouse before it says it is ready (``ft/loop.make_manager``).

torchft's lighthouse waits for the replicas it has heard from: one whose first heartbeat has
not arrived is not waited for, and a quorum forms without it. A Manager heartbeats from a
thread of its own, so on a loaded machine a replica could report ready (and the launcher say
go) before its first heartbeat left; its peers' first quorum then formed without it, and they
trained the first steps alone. ``make_manager`` therefore sends the heartbeat itself and
returns only once the lighthouse answered (``lighthouse.announce``).

The test forces the race to its worst case: the Manager is a stand-in whose heartbeat never
leaves at all (what a replica stopped before its thread's first heartbeat looks like). Once
replica B's ``make_manager`` returns, replica A asks for a quorum: the lighthouse must wait
for B, and the quorum must hold both. Without the wait it forms at once with A alone. Nothing
here depends on which thread runs first: the lighthouse's timeouts are a minute, and B asks
for its quorum only after A's request has been sent.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from commfuse.ft import FaultToleranceConfig
from commfuse.ft.lighthouse import start_lighthouse
from commfuse.ft.loop import ReplicaJob, make_manager
from commfuse.train.loop import TrainConfig
from commfuse.workloads import CharLMConfig

pytest.importorskip("torchft")

#: Every wait of the lighthouse (heartbeat expiry, join) a minute: far past any load's delay.
FT = FaultToleranceConfig(timeout_s=60.0, min_replicas=1)
WAIT = timedelta(seconds=120)


class _Silent:
    """A torchft ``Manager`` that files its replica id in the group's store, as the real one
    does, and never heartbeats."""

    def __init__(self, *, replica_id: str, store_addr: str, store_port: int, **_: Any) -> None:
        from torchft.manager import REPLICA_ID_KEY

        store = dist.TCPStore(store_addr, store_port, is_master=False, timeout=WAIT)  # type: ignore[attr-defined]
        store.set(REPLICA_ID_KEY, f"{replica_id}:silent")


def test_a_replica_is_in_the_first_quorum_though_its_manager_never_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torchft
    from torchft.coordination import LighthouseClient

    monkeypatch.setattr(torchft, "Manager", _Silent)
    lighthouse = start_lighthouse("127.0.0.1", netns=None, timeouts=FT.timeouts, min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    try:
        job = ReplicaJob(
            train=TrainConfig(workload=CharLMConfig(), steps=1),
            ft=FT,
            replica=1,
            num_replicas=2,
            life=0,
            addr="127.0.0.1",
            store_port=store.port,
            lighthouse=lighthouse.url,
        )
        make_manager(job, None, None, dict, lambda state: None)  # B says ready after this
        client = LighthouseClient(lighthouse.url, connect_timeout=WAIT)
        quorums: dict[str, Any] = {}

        def ask(replica_id: str) -> None:
            quorums[replica_id] = client.quorum(replica_id=replica_id, timeout=WAIT)

        first = threading.Thread(target=ask, args=("replica_000:a",))
        first.start()
        # A's request is on its way (the quorum it gets is what is asserted); give it time to
        # arrive, then B asks too, as a replica told to go does.
        first.join(timeout=2.0)
        formed_alone = not first.is_alive()
        if not formed_alone:
            ask("replica_001:silent")
        first.join(timeout=WAIT.total_seconds())
        members = sorted(m.replica_id for m in quorums["replica_000:a"].participants)
        assert not formed_alone and members == ["replica_000:a", "replica_001:silent"], (
            f"A's first quorum: {members}; the lighthouse had not heard of B when it said ready"
        )
    finally:
        lighthouse.shutdown()

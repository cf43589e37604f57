"""The lighthouse (torchft's quorum server), run by the launcher inside the emulated cluster.

It runs in the launcher's process, on a socket bound to the first emulated host's own address
(loopback when the network is not emulated), never on every interface. Being a part of the
launcher, it stops with the job, and with the launcher if that is killed.

A replica counts for a quorum once the lighthouse has its heartbeat: one that has not been
heard yet is not waited for, and a quorum can form without it. A Manager's heartbeats start on
a thread of their own, so a replica sends its first one itself and reports ready only after
the lighthouse answered (``announce``): the launcher's go then finds every replica known.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from commfuse.ft.config import Timeouts
from commfuse.ft.require import require_torchft


@dataclass
class _Lighthouse:
    """A running lighthouse and the URL its replicas reach it at."""

    server: Any
    """torchft's ``LighthouseServer``."""
    url: str
    """``http://ADDR:PORT``."""

    def shutdown(self) -> None:
        """Stop serving."""
        self.server.shutdown()


def start_lighthouse(
    addr: str, *, netns: str | None, timeouts: Timeouts, min_replicas: int
) -> _Lighthouse:
    """Start a lighthouse on ``addr`` (inside network namespace ``netns`` when given).

    Args:
        addr: the address to listen on (an emulated host's, or loopback).
        netns: the namespace that address lives in; None: this process's.
        timeouts: heartbeat, join and tick intervals (``Timeouts.derive``).
        min_replicas: the fewest replica groups a quorum may have.

    Returns:
        The running lighthouse.
    """
    require_torchft()
    from torchft.coordination import LighthouseServer

    def make() -> Any:
        return LighthouseServer(
            bind=f"{addr}:0",
            min_replicas=min_replicas,
            join_timeout_ms=round(timeouts.join_timeout_s * 1000),
            quorum_tick_ms=max(1, round(timeouts.quorum_tick_s * 1000)),
            heartbeat_timeout_ms=round(timeouts.heartbeat_timeout_s * 1000),
        )

    if netns is None:
        server = make()
    else:
        from commfuse.cluster.netns import call_in_netns

        # The socket is bound inside the namespace and stays there; the server's threads
        # only accept on it.
        server = call_in_netns(netns, make)
    port = int(server.address().rsplit(":", 1)[1])
    return _Lighthouse(server=server, url=f"http://{addr}:{port}")


def announce(lighthouse_url: str, replica_id: str, timeout: timedelta) -> None:
    """Send replica ``replica_id``'s heartbeat to the lighthouse and return once it has it.

    torchft's Manager heartbeats from a thread it starts, and nothing waits for the first
    heartbeat to arrive: on a loaded machine a replica could report ready while the
    lighthouse had not heard of it, and the other replicas' first quorum would form without
    it (the lighthouse waits only for replicas it knows), training the first steps alone.

    Args:
        lighthouse_url: the lighthouse's URL.
        replica_id: the id the replica's Manager heartbeats under (its own, with its suffix).
        timeout: how long to connect and to wait for the answer.
    """
    require_torchft()
    from torchft.coordination import LighthouseClient

    LighthouseClient(lighthouse_url, connect_timeout=timeout).heartbeat(replica_id, timeout=timeout)

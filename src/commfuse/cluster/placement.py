"""Where each rank runs: on plain loopback, or inside its emulated host's network namespace.

``open_placement`` is the one place that decides whether to build an emulated network: a job
with more than one host or a shaped link gets a netlab when we are allowed to build one, and
otherwise runs on loopback after saying so once.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from commfuse.cluster.env import rank_env
from commfuse.cluster.topology import Topology

if TYPE_CHECKING:
    from commfuse.cluster.netlab import Netlab

_LOOPBACK_ADDR = "127.0.0.1"
_LOOPBACK_IFNAME = "lo"

_warned_unemulated = False


def _warn_unemulated(reason: str) -> None:
    """Say once per process that the network is not emulated, and why."""
    global _warned_unemulated
    if not _warned_unemulated:
        _warned_unemulated = True
        print(
            f"commfuse: network not emulated ({reason}); running every rank on plain loopback, "
            "so host links are not shaped",
            file=sys.stderr,
        )


@dataclass
class Placement:
    """The network side of a job: a netlab, or nothing (loopback)."""

    topology: Topology
    lab: Netlab | None = None

    @property
    def emulated(self) -> bool:
        return self.lab is not None

    def netns_of(self, rank: int) -> str | None:
        return None if self.lab is None else self.lab.namespace(self.topology.host_of(rank))

    def ifname_of(self, rank: int) -> str:
        return (
            _LOOPBACK_IFNAME if self.lab is None else self.lab.ifname(self.topology.host_of(rank))
        )

    def addr_of_host(self, host: int) -> str:
        return _LOOPBACK_ADDR if self.lab is None else self.lab.address(host)

    @property
    def master_addr(self) -> str:
        return self.addr_of_host(0)

    @property
    def master_netns(self) -> str | None:
        return self.netns_of(0)

    @property
    def lab_id(self) -> str | None:
        return None if self.lab is None else self.lab.lab_id

    def env_of(
        self, rank: int, *, master_addr: str, master_port: int, run_id: str
    ) -> dict[str, str]:
        """The whole environment of ``rank``: the torchrun contract plus where it runs."""
        return rank_env(
            self.topology,
            rank,
            master_addr=master_addr,
            master_port=master_port,
            run_id=run_id,
            socket_ifname=self.ifname_of(rank),
            netlab_id=self.lab_id,
        )


def wants_emulation(topology: Topology) -> bool:
    return topology.num_hosts > 1 or topology.link_mbit is not None


@contextlib.contextmanager
def open_placement(topology: Topology, *, emulate: bool | None = None) -> Iterator[Placement]:
    """Build the network a job needs and tear it down afterwards, whatever happens.

    ``emulate=None`` emulates when the topology has several hosts or a link rate; ``False``
    forces loopback; ``True`` insists and raises when a netlab cannot be built.
    """
    want = wants_emulation(topology) if emulate is None else emulate
    if not want:
        yield Placement(topology)
        return
    from commfuse.cluster.netlab import Netlab, netlab_unavailable_reason

    reason = netlab_unavailable_reason()
    if reason is not None:
        if emulate:
            raise RuntimeError(f"cannot emulate the network: {reason}")
        _warn_unemulated(reason)
        yield Placement(topology)
        return
    with Netlab(topology) as lab:
        yield Placement(topology, lab)

"""The shape of a (possibly emulated) cluster: hosts, ranks per host, and the link of each host.

Ranks are placed host-major, as torchrun places them across nodes: rank r lives on host
``r // ranks_per_host`` with local rank ``r % ranks_per_host``.
"""

from __future__ import annotations

import dataclasses

from commfuse.cluster.rank_runtime import comm_settings
from commfuse.units import format_rate, parse_rate_mbit

#: More ranks than this on one machine is refused: each rank is a full torch process.
_MAX_LOCAL_RANKS = 64
#: The bridge and addressing scheme hold at most this many emulated hosts (netlab's addresses
#: 10.77.0.100 up to 10.77.0.163 keep three-digit last octets, see netlab.FIRST_HOST_OCTET).
MAX_HOSTS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """Hosts joined by per-host links; ranks of one host share its loopback."""

    num_hosts: int = 1
    """Number of hosts (network namespaces when emulated)."""
    ranks_per_host: int = 1
    """Ranks on each host; they talk over the host's loopback."""
    link_mbit: float | None = None
    """Each host's link rate in Mbit/s, each direction; None leaves links unshaped."""

    def __post_init__(self) -> None:
        if self.num_hosts < 1:
            raise ValueError(f"num_hosts must be at least 1, got {self.num_hosts}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be at least 1, got {self.ranks_per_host}")
        if self.num_hosts > MAX_HOSTS:
            raise ValueError(
                f"num_hosts {self.num_hosts} is more than the {MAX_HOSTS} this emulation supports"
            )
        if self.world_size > _MAX_LOCAL_RANKS:
            raise ValueError(
                f"{self.world_size} ranks is more than this machine can hold "
                f"(at most {_MAX_LOCAL_RANKS}); lower num_hosts or ranks_per_host"
            )
        if self.link_mbit is not None and self.link_mbit <= 0:
            raise ValueError(f"link_mbit must be more than 0, got {self.link_mbit}")

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    @property
    def link_gbit(self) -> float | None:
        return None if self.link_mbit is None else self.link_mbit / 1000.0

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_host

    def describe(self) -> str:
        link = "unshaped" if self.link_mbit is None else format_rate(self.link_mbit)
        return f"{self.num_hosts} host(s) x {self.ranks_per_host} rank(s), link {link}"

    @classmethod
    def from_spec(cls, *, hosts: int, ranks_per_host: int = 1, link: str | None = None) -> Topology:
        """Build from command-line words: ``hosts=4, ranks_per_host=1, link="1gbit"``;
        ``link`` None, ``"none"`` or ``"off"`` means unshaped (how to override a shaped default)."""
        if link is not None and link.strip().lower() in ("none", "off"):
            link = None
        return cls(
            num_hosts=hosts,
            ranks_per_host=ranks_per_host,
            link_mbit=None if link is None else parse_rate_mbit(link),
        )

    @classmethod
    def of_rank(cls, world_size: int) -> Topology:
        """The layout of the job this rank was started in (its ``CommSettings``: ranks per host
        and link rate), for a world of ``world_size`` ranks."""
        settings = comm_settings()
        local = settings.ranks_per_host or world_size
        if world_size % local:
            # Uneven hosts cannot be described by this type; treat the job as one host.
            return cls(num_hosts=1, ranks_per_host=world_size)
        return cls(
            num_hosts=world_size // local, ranks_per_host=local, link_mbit=settings.link_mbit
        )

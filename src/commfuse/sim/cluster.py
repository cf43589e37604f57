"""The cluster model: hosts, links, compute rates, stragglers; JSON with units in the keys.

A cluster is ``num_hosts`` hosts of ``ranks_per_host`` ranks, placed host-major as torchrun does
(rank r on host r // ranks_per_host). Three kinds of link carry traffic, each a Hockney pair
(latency alpha, seconds per byte beta, see ``collectives/cost.py``):

1. inside a host (NVLink, or loopback on the emulated cluster), one bus per host;
2. each host's network interface to the fabric (400 Gbit/s per GPU on a DGX H100, the shaped veth
   on the emulated cluster), optionally oversubscribed in the fabric's core;
3. optionally, a wide-area link between ``num_datacenters`` equal groups of hosts.

Every rank computes at ``flops_per_s`` (the rate it achieves, not the peak) and moves memory at
``mem_gbyte_per_s``; ``stragglers`` slow chosen ranks down or delay their start.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from commfuse.collectives.cost import LinkCost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Straggler:
    """One rank that computes slower than the rest, or starts each step late."""

    rank: int
    """Which rank."""
    slowdown: float = 1.0
    """Its compute takes this many times longer (1.0: normal speed)."""
    delay_us: float = 0.0
    """It starts every step this late (an OS hiccup, a slow data loader)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveLink:
    """The link as one collective algorithm sees it, fitted to its own measured times.

    gloo's native collectives are not built on our point-to-point path: its broadcast is a
    binomial tree, its allreduce a ring, its all-to-all pairwise, each with its own per-message
    cost and achieved rate. ``commfuse simulate --calibrate`` fits alpha and beta of each against
    its own model (``sim/fit.py``); the simulator then prices that algorithm with this pair on the
    host links instead of the cluster's point-to-point ``inter_*`` pair."""

    collective: str
    """all_reduce, broadcast, all_to_all, all_gather, ..."""
    algorithm: str
    """The registered algorithm name (``native`` for gloo's own)."""
    latency_us: float
    """Fitted alpha, microseconds per message."""
    gbit_per_s: float
    """Fitted 1 / beta, Gbit/s."""
    latency_overlaps_transfer: bool = False
    """The algorithm's message start-ups run under its transfers, so its idle time is the smooth
    maximum ``sqrt(L**2 + W**2)`` of its latency-bound time L and bandwidth-bound time W, not
    ``L + W`` (``fit.overlapped``). gloo's allreduce cuts every chunk into segments and keeps
    one in flight while it reduces another; measured: 6 start-ups of about 1 ms each below
    512 KB, under 2 ms of excess over the wire time from 1 MB up, where L + W predicted +28% to
    +43% at 1 MB."""

    def __post_init__(self) -> None:
        if self.latency_us < 0 or not math.isfinite(self.latency_us):
            raise ValueError(
                f"{self.collective}/{self.algorithm} latency_us must be >= 0, got {self.latency_us}"
            )
        if not (self.gbit_per_s > 0 and math.isfinite(self.gbit_per_s)):
            raise ValueError(
                f"{self.collective}/{self.algorithm} gbit_per_s must be positive, "
                f"got {self.gbit_per_s}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterModel:
    """What the simulator knows about a cluster. ``to_json``/``from_json`` round-trip it."""

    name: str = "custom"
    """A label for reports."""
    num_hosts: int = 1
    """Hosts (nodes)."""
    ranks_per_host: int = 1
    """Ranks (GPUs, processes) per host."""
    intra_gbyte_per_s: float = 1.0
    """Bandwidth between two ranks of one host, GB/s (1e9 bytes), each direction."""
    intra_latency_us: float = 60.0
    """Per-message latency inside a host, microseconds."""
    inter_gbit_per_s: float = 1.0
    """Each host's network link, Gbit/s, each direction."""
    inter_latency_us: float = 100.0
    """Per-message latency between hosts, microseconds."""
    inter_burst_kbyte: float = 0.0
    """Token bucket of each host link, KiB: the first this many bytes a collective sends through
    an idle host link pass at once (tbf's ``burst`` on the emulated cluster; 0 on a real NIC)."""
    reduce_gbyte_per_s: float = 4.0
    """Rate of a local reduction (adding received data), GB/s (cost.py's 1 / gamma)."""
    flops_per_s: float = 1e10
    """Achieved compute rate of one rank, FLOP/s."""
    mem_gbyte_per_s: float = 10.0
    """Achieved memory bandwidth of one rank, GB/s (element-wise work: optimizer, compression)."""
    memory_gbyte: float = 16.0
    """Memory of one rank, GB; a workload that needs more is refused."""
    oversubscription: float = 1.0
    """Core fabric oversubscription: traffic between switches gets 1/this of the link rate."""
    hosts_per_switch: int = 0
    """Hosts under one leaf switch (0: all hosts, no oversubscription applies)."""
    num_datacenters: int = 1
    """Equal groups of hosts joined by one wide-area link."""
    interdc_gbit_per_s: float = 10.0
    """The wide-area link between data centers, Gbit/s, each direction."""
    interdc_latency_us: float = 10_000.0
    """Latency across data centers, microseconds."""
    stragglers: tuple[Straggler, ...] = ()
    """Ranks slower than the rest."""
    profile_path: str = ""
    """A ``commfuse tune`` profile whose measured corrections apply (same world size only)."""
    collective_links: tuple[CollectiveLink, ...] = ()
    """Per-algorithm fitted host links (``commfuse simulate --calibrate``); others use inter_*."""
    comm_cpu_us_per_mbyte: float = 0.0
    """CPU time a rank's compute loses per MB (1e6 bytes) of collective payload that is in
    flight while it computes, microseconds (``sim/cpu_share.py``). 0 on a real cluster, where
    NICs and GPUs move the bytes; on the emulated cluster the veths, bridge, tbf and gloo's
    threads run on the ranks' own cores, so calibration fits it from a communicating step."""

    def __post_init__(self) -> None:
        for name in ("num_hosts", "ranks_per_host", "num_datacenters"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"cluster {name} must be at least 1, got {getattr(self, name)}")
        positive = (
            "intra_gbyte_per_s",
            "inter_gbit_per_s",
            "reduce_gbyte_per_s",
            "flops_per_s",
            "mem_gbyte_per_s",
            "memory_gbyte",
            "interdc_gbit_per_s",
        )
        for name in positive:
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"cluster {name} must be a positive number, got {value!r}")
        for name in (
            "intra_latency_us",
            "inter_latency_us",
            "interdc_latency_us",
            "inter_burst_kbyte",
            "comm_cpu_us_per_mbyte",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster {name} must be >= 0, got {getattr(self, name)}")
        if self.oversubscription < 1:
            raise ValueError(f"cluster oversubscription must be >= 1, got {self.oversubscription}")
        if self.hosts_per_switch < 0:
            raise ValueError(f"cluster hosts_per_switch must be >= 0, got {self.hosts_per_switch}")
        if self.num_hosts % self.num_datacenters:
            raise ValueError(
                f"num_hosts {self.num_hosts} must divide evenly into "
                f"num_datacenters {self.num_datacenters}"
            )
        for s in self.stragglers:
            if not 0 <= s.rank < self.world_size:
                raise ValueError(f"straggler rank {s.rank} outside 0..{self.world_size - 1}")
            if s.slowdown < 1 or s.delay_us < 0:
                raise ValueError(
                    f"straggler rank {s.rank}: slowdown must be >= 1 and delay_us >= 0"
                )

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    @property
    def gamma_s_per_byte(self) -> float:
        return 1.0 / (self.reduce_gbyte_per_s * 1e9)

    def collective_link(self, collective: str, algorithm: str) -> CollectiveLink | None:
        """The fitted link of ``collective``/``algorithm``, if calibration measured one."""
        for link in self.collective_links:
            if link.collective == collective and link.algorithm == algorithm:
                return link
        return None

    def intra_cost(self) -> LinkCost:
        return LinkCost(
            alpha_s=self.intra_latency_us * 1e-6,
            beta_s_per_byte=1.0 / (self.intra_gbyte_per_s * 1e9),
            gamma_s_per_byte=self.gamma_s_per_byte,
        )

    def inter_cost(self) -> LinkCost:
        return LinkCost(
            alpha_s=self.inter_latency_us * 1e-6,
            beta_s_per_byte=8.0 / (self.inter_gbit_per_s * 1e9),
            gamma_s_per_byte=self.gamma_s_per_byte,
        )

    def interdc_cost(self) -> LinkCost:
        return LinkCost(
            alpha_s=self.interdc_latency_us * 1e-6,
            beta_s_per_byte=8.0 / (self.interdc_gbit_per_s * 1e9),
            gamma_s_per_byte=self.gamma_s_per_byte,
        )

    def with_hosts(self, num_hosts: int) -> ClusterModel:
        """The same cluster with another number of hosts (for ``--scale``); stragglers outside
        the new world are dropped, data centers kept where they divide the hosts."""
        dcs = self.num_datacenters if num_hosts % self.num_datacenters == 0 else 1
        world = num_hosts * self.ranks_per_host
        keep = tuple(s for s in self.stragglers if s.rank < world)
        return dataclasses.replace(self, num_hosts=num_hosts, num_datacenters=dcs, stragglers=keep)

    def with_ranks(self, ranks: int) -> ClusterModel:
        """``ranks`` ranks: whole hosts of ``ranks_per_host``, or one partial host below that."""
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        if ranks < self.ranks_per_host:
            return dataclasses.replace(
                self.with_hosts(1), ranks_per_host=ranks, num_datacenters=1, stragglers=()
            )
        if ranks % self.ranks_per_host:
            raise ValueError(
                f"ranks {ranks} is not a multiple of the cluster's {self.ranks_per_host} "
                "ranks per host"
            )
        return self.with_hosts(ranks // self.ranks_per_host)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterModel:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown cluster keys {unknown}; known keys (units in the names): {sorted(known)}"
            )
        data = dict(data)
        data["stragglers"] = tuple(Straggler(**s) for s in data.get("stragglers", ()))
        data["collective_links"] = tuple(
            CollectiveLink(**c) for c in data.get("collective_links", ())
        )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> ClusterModel:
        return cls.from_dict(json.loads(text))


#: Built-in clusters. ``netlab-1gbit`` is the emulated cluster as ``commfuse tune`` measured it on
#: 4 hosts x 1 rank (benchmarks/tune_netlab-4x1gbit-2core.json: alpha 51.9 us,
#: 0.131 GB/s across hosts, reductions at 9.1 GB/s; loopback about 1 GB/s, docs/design.md), with
#: netlab's tbf bucket of 256 KiB (``commfuse simulate --validate --save-cluster`` refits it).
#: ``dgx-h100`` is a DGX-H100-like node: 8 GPUs on NVLink (about 450 GB/s each way), one
#: 400 Gbit/s NIC per GPU (so 3.2 Tbit/s per host), about 40% of the 989 TFLOP/s bf16 peak.
PRESETS: dict[str, ClusterModel] = {
    "netlab-1gbit": ClusterModel(
        name="netlab-1gbit",
        num_hosts=4,
        ranks_per_host=1,
        intra_gbyte_per_s=1.0,
        intra_latency_us=60.0,
        inter_gbit_per_s=1.05,
        inter_latency_us=51.9,
        inter_burst_kbyte=256.0,
        reduce_gbyte_per_s=9.1,
        flops_per_s=2e10,
        mem_gbyte_per_s=5.0,
        memory_gbyte=8.0,
    ),
    "dgx-h100": ClusterModel(
        name="dgx-h100",
        num_hosts=16,
        ranks_per_host=8,
        intra_gbyte_per_s=450.0,
        intra_latency_us=3.0,
        inter_gbit_per_s=3200.0,
        inter_latency_us=8.0,
        reduce_gbyte_per_s=1000.0,
        flops_per_s=4e14,
        mem_gbyte_per_s=3000.0,
        memory_gbyte=80.0,
    ),
}
"""The built-in cluster models by name (``netlab-1gbit``, ``dgx-h100``, ``two-dc``), as
``commfuse simulate --cluster NAME`` takes them."""
#: A DGX-H100-like cluster split over two data centers joined by 100 Gbit/s (DiLoCo's setting).
PRESETS["two-dc"] = dataclasses.replace(
    PRESETS["dgx-h100"],
    name="two-dc",
    num_datacenters=2,
    interdc_gbit_per_s=100.0,
    interdc_latency_us=5000.0,
)


def load_cluster(spec: str) -> ClusterModel:
    """A preset name or a path to a cluster JSON file."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith(".json"):
        from pathlib import Path

        return ClusterModel.from_json(Path(spec).read_text())
    raise ValueError(
        f"unknown cluster {spec!r}: use a preset ({', '.join(PRESETS)}) or a JSON file"
    )

"""What one collective asks of the network: a latency and the busy time of each kind of link.

The simulator prices a collective with the very formulas the tuner uses (``collectives/cost.py``,
Thakur-Rabenseifner-Gropp 2005 and Wang et al. arXiv 1611.04255), split in two, because the two
parts behave differently when the network is shared:

* ``latency_s``: the alpha and gamma terms (message start-ups, local reductions); another flow on
  the same link does not make them longer;
* ``busy_s[resource]``: the beta terms, per resource the collective crosses (``intra``: a host's
  bus; ``nic``: each host's network link; ``wan``: the link between data centers). On an idle
  network the slowest resource sets the pace; the engine divides each resource's bandwidth among
  the flows that use it at the same time.

The cost formulas are linear in alpha, beta and gamma, so evaluating them with beta = 0 gives the
latency part and with alpha = gamma = 0 the bandwidth part; on an idle network with one rank per
host the sum is exactly ``cost.py``'s closed form. How a group spread over hosts loads each link
depends on the algorithm's shape (ranks are host-major):

1. chain algorithms (ring, linear pipeline; gloo's allreduce and allgather are rings) cross each
   host boundary once, so each host link carries one stream per group;
2. trees (binomial broadcast and reduce) take their largest hops first, when only one rank per
   host holds data: one tree across hosts, then one inside each host (phases add);
3. recursive doubling and halving, and pairwise all-to-all, send from every rank of a host at
   once in the steps that leave the host: that host's link is shared by all of them;
4. hierarchical: inside each host, then across hosts with 1/L of the data per rank, then inside.

Design notes: ``docs/simulator.md``, "Links fitted to one algorithm".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path

from commfuse.collectives import cost as C
from commfuse.collectives.profile import Profile
from commfuse.collectives.registry import COLLECTIVES, resolve
from commfuse.collectives.tuner import choose_for, predict
from commfuse.sim import lp
from commfuse.sim.cluster import ClusterModel

_RESOURCES = ("intra", "nic", "wan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """The shape of the groups one collective runs on (all groups of a kind run at once)."""

    size: int
    """Ranks in one group."""
    ranks_per_host: int
    """Ranks of one group on each host it spans."""
    groups_per_host: int = 1
    """Groups of this kind with ranks on each host (they share its link)."""
    num_groups: int = 1
    """Groups of this kind in the world (those spanning data centers share the wide-area link)."""

    @property
    def hosts(self) -> int:
        return self.size // self.ranks_per_host


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demand:
    """Latency (not shared) and busy seconds per resource (shared) of one collective."""

    latency_s: float
    """Start-ups and local reductions, seconds: a flow sharing the link does not stretch them."""
    busy_s: dict[str, float]
    """Seconds each resource (``_RESOURCES``) is busy moving the bytes at its full rate; shared
    resources stretch them."""

    @property
    def idle_s(self) -> float:
        """Time on an otherwise idle network."""
        return self.latency_s + max(self.busy_s.values(), default=0.0)


_Fn = Callable[[int, int, C.LinkCost], float]
#: (collective, algorithm) -> (shape, cost.py formula). Native follows gloo (docs/design.md): ring
#: allreduce and allgather, binomial broadcast and reduce, reduce-scatter as a full allreduce.
_SHAPES: dict[tuple[str, str], tuple[str, _Fn]] = {
    ("all_reduce", "native"): ("chain", C.ring_all_reduce),
    ("all_reduce", "ring"): ("chain", C.ring_all_reduce),
    ("all_reduce", "pipeline"): ("chain", C.lp_all_reduce),
    ("all_reduce", "doubling"): ("spread", C.recursive_doubling_all_reduce),
    ("all_reduce", "rabenseifner"): ("spread", C.rabenseifner_all_reduce),
    ("broadcast", "native"): ("tree", C.gloo_broadcast),
    ("broadcast", "tree"): ("tree", C.mst_broadcast),
    ("broadcast", "pipeline"): ("chain", C.lp_broadcast),
    ("reduce", "native"): ("tree", C.mst_reduce),
    ("reduce", "tree"): ("tree", C.mst_reduce),
    ("reduce", "pipeline"): ("chain", C.lp_reduce),
    ("all_gather", "native"): ("chain", C.ring_all_gather),
    ("all_gather", "ring"): ("chain", C.ring_all_gather),
    ("all_gather", "doubling"): ("spread", C.recursive_doubling_all_gather),
    ("reduce_scatter", "native"): ("chain", C.ring_all_reduce),
    ("reduce_scatter", "ring"): ("chain", C.ring_reduce_scatter),
    ("reduce_scatter", "halving"): ("spread", C.ring_reduce_scatter),
    ("all_to_all", "native"): ("all_to_all", C.pairwise_all_to_all),
    ("all_to_all", "pairwise"): ("all_to_all", C.pairwise_all_to_all),
}
_PIPELINES = {"broadcast", "reduce", "all_reduce"}


def _known_algorithms(collective: str) -> list[str]:
    hier = {"hierarchical"} if collective in ("all_reduce", "broadcast") else set()
    return sorted({a for c, a in _SHAPES if c == collective} | {"auto"} | hier)


@functools.lru_cache(maxsize=16)
def _load_profile(path: str) -> Profile:
    return Profile.from_json(Path(path).read_text())


def profile_of(cluster: ClusterModel) -> Profile:
    """The tuner's view of ``cluster``: its links, plus a measured profile's corrections and
    pipeline block costs where the cluster names one."""
    base = Profile(
        intra=cluster.intra_cost(),
        inter=cluster.inter_cost() if cluster.num_hosts > 1 else cluster.intra_cost(),
        num_hosts=cluster.num_hosts,
        ranks_per_host=cluster.ranks_per_host,
    )
    if not cluster.profile_path:
        return base
    measured = _load_profile(cluster.profile_path)
    return dataclasses.replace(
        base,
        corrections=measured.corrections,
        tuned_blocks=measured.tuned_blocks,
        pipeline_alpha_s=measured.pipeline_alpha_s,
    )


def _split(fn: _Fn, n: int, p: int, link: C.LinkCost) -> tuple[float, float]:
    """(alpha + gamma part, beta part) of a formula, by linearity."""
    latency = fn(n, p, dataclasses.replace(link, beta_s_per_byte=0.0))
    bandwidth = fn(n, p, dataclasses.replace(link, alpha_s=0.0, gamma_s_per_byte=0.0))
    return latency, bandwidth


def _with_beta(link: C.LinkCost, factor: float) -> C.LinkCost:
    return dataclasses.replace(link, beta_s_per_byte=link.beta_s_per_byte * factor)


def demand(
    collective: str,
    algo: str,
    nbytes: int,
    group: Group,
    cluster: ClusterModel,
    profile: Profile | None = None,
) -> Demand:
    """The network demand of one ``collective`` of ``nbytes`` (nccl-tests' S: the full buffer)
    run with ``algo`` on every group of shape ``group``. ValueError for unknown names."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    if nbytes < 0:
        raise ValueError(f"{collective}: message size must be >= 0 bytes, got {nbytes}")
    profile = profile or profile_of(cluster)
    p = group.size
    if p <= 1 or nbytes == 0:
        return Demand(latency_s=0.0, busy_s={})
    name = resolve(collective, algo)
    if name == "auto":
        name = choose_for(collective, nbytes, p, profile)
    if name != "hierarchical" and (collective, name) not in _SHAPES:
        raise ValueError(
            f"unknown algorithm {algo!r} for {collective}; known: "
            f"{', '.join(_known_algorithms(collective))}"
        )
    hosts = group.hosts
    dcs = min(cluster.num_datacenters, hosts) if hosts > 1 else 1
    intra = cluster.intra_cost()
    inter = cluster.inter_cost()
    own = cluster.collective_link(collective, name)
    if own is not None:
        # Calibrated against this very algorithm's own model (``sim/fit.py``): its alpha and
        # beta, not the point-to-point pair, price its steps across hosts.
        inter = dataclasses.replace(
            inter,
            alpha_s=own.latency_us * 1e-6,
            beta_s_per_byte=8.0 / (own.gbit_per_s * 1e9),
        )
    if 0 < cluster.hosts_per_switch < hosts:
        inter = _with_beta(inter, cluster.oversubscription)
    wan = cluster.interdc_cost()
    if name == "hierarchical":
        result = _hierarchical(collective, nbytes, group, intra, inter)
    else:
        shape, fn = _SHAPES[(collective, name)]
        if name == "pipeline":
            result = _pipeline(collective, nbytes, group, dcs, intra, inter, wan, cluster, profile)
        else:
            result = _flat(shape, fn, nbytes, group, dcs, intra, inter, wan)
    if cluster.inter_burst_kbyte > 0 and "nic" in result.busy_s:
        # The host link's token bucket is full when the collective starts: its first bytes pass
        # at once, the rest at the link rate (netlab's tbf; ``fit.with_burst`` is the same).
        burst = cluster.inter_burst_kbyte * 1024
        if (collective, name) == ("broadcast", "native"):
            burst = C.gloo_broadcast_burst_bytes(nbytes, hosts, burst)  # a full bucket per hop
        credit = burst * inter.beta_s_per_byte
        busy = dict(result.busy_s)
        busy["nic"] = max(busy["nic"] - credit, 0.0)
        result = Demand(latency_s=result.latency_s, busy_s=busy)
    if own is not None and own.latency_overlaps_transfer:
        # Smooth maximum of latency and transfer (CollectiveLink): the latency part shrinks to
        # what is left above the transfer, so contention still stretches the transfer.
        transfer = max(result.busy_s.values(), default=0.0)
        overlapped = math.hypot(result.latency_s, transfer) - transfer
        result = Demand(latency_s=overlapped, busy_s=result.busy_s)
    if profile.correction(collective, name, p) is not None:
        # Measured on this very group: scale both parts so the idle time is the tuner's
        # corrected prediction, whatever our model of the shape says.
        ratio = predict(collective, name, nbytes, p, profile) / result.idle_s
        result = Demand(
            latency_s=result.latency_s * ratio,
            busy_s={k: v * ratio for k, v in result.busy_s.items()},
        )
    return result


def _flat(
    shape: str,
    fn: _Fn,
    n: int,
    group: Group,
    dcs: int,
    intra: C.LinkCost,
    inter: C.LinkCost,
    wan: C.LinkCost,
) -> Demand:
    p, local, hosts = group.size, group.ranks_per_host, group.hosts
    # The slowest link a step crosses sets its start-up latency.
    slowest = wan if dcs > 1 else inter if hosts > 1 else intra
    gamma = intra.gamma_s_per_byte
    link_alpha = dataclasses.replace(slowest, gamma_s_per_byte=gamma)
    if shape == "tree":
        # Largest hops first: across data centers, then hosts, then inside a host (phases add).
        levels = [("wan", dcs, wan), ("nic", hosts // dcs, inter), ("intra", local, intra)]
        latency, busy = 0.0, dict[str, float]()
        for resource, count, link in levels:
            if count > 1:
                lat, bw = _split(fn, n, count, link)
                share = {"nic": group.groups_per_host, "wan": group.num_groups}.get(resource, 1)
                latency += lat
                busy[resource] = busy.get(resource, 0.0) + bw * share
        # Phases run one after another: their busy times add, so report them as one resource
        # chain whose slowest element is the sum (the engine shares each by its own load).
        total = sum(busy.values())
        return Demand(latency_s=latency, busy_s={k: total for k in busy})
    latency, _ = _split(fn, n, p, link_alpha)
    # How many of one group's streams cross each resource at once (module docstring, 1-3).
    if shape == "chain":
        at_once = {"intra": 1, "nic": 1, "wan": 1}
    else:
        at_once = {"intra": 1, "nic": local, "wan": local * (hosts // dcs)}
    at_once["nic"] *= group.groups_per_host
    at_once["wan"] *= group.num_groups
    busy = dict[str, float]()
    if shape == "all_to_all":
        # Exact bytes: each rank sends n/p to each other rank; count what leaves a host / DC.
        per_dc = p // dcs
        if local > 1:
            busy["intra"] = (local - 1) / p * n * intra.beta_s_per_byte
        if hosts > 1:
            busy["nic"] = local * (p - local) / p * n * inter.beta_s_per_byte
            busy["nic"] *= group.groups_per_host
        if dcs > 1:
            busy["wan"] = per_dc * (p - per_dc) / p * n * wan.beta_s_per_byte * group.num_groups
        return Demand(latency_s=latency, busy_s=busy)
    for resource, link, spans in (
        ("intra", intra, local > 1),
        ("nic", inter, hosts > 1),
        ("wan", wan, dcs > 1),
    ):
        if spans:
            busy[resource] = _split(fn, n, p, _with_beta(link, at_once[resource]))[1]
    return Demand(latency_s=latency, busy_s=busy)


def _pipeline(
    collective: str,
    n: int,
    group: Group,
    dcs: int,
    intra: C.LinkCost,
    inter: C.LinkCost,
    wan: C.LinkCost,
    cluster: ClusterModel,
    profile: Profile,
) -> Demand:
    """commfuse's linear pipeline at the block the code picks, priced as it runs (``lp.py``)."""
    hosts = group.hosts
    slowest, link = ("wan", wan) if dcs > 1 else ("nic", inter) if hosts > 1 else ("intra", intra)
    betas = {}
    if group.ranks_per_host > 1:
        betas["intra"] = intra.beta_s_per_byte
    if hosts > 1:
        betas["nic"] = inter.beta_s_per_byte * group.groups_per_host
    if dcs > 1:
        betas["wan"] = wan.beta_s_per_byte * group.num_groups
    paced = dataclasses.replace(link, beta_s_per_byte=betas[slowest])
    block = lp.block_bytes(collective, n, group.size, paced, profile)
    latency, busy = lp.pipeline_cost(
        collective,
        n,
        group.size,
        block,
        alpha_s=profile.pipeline_alpha_s.get(collective, link.alpha_s),
        gamma_s_per_byte=intra.gamma_s_per_byte,
        beta_by_resource=betas,
        burst_by_resource={"nic": cluster.inter_burst_kbyte * 1024},
        slowest=slowest,
    )
    return Demand(latency_s=latency, busy_s=busy)


def pipeline_block_bytes(collective: str, nbytes: int, cluster: ClusterModel) -> int:
    """The block the simulator prices ``collective`` at on the whole of ``cluster`` (what
    ``--validate`` passes to the real call, so both run the same blocks)."""
    group = Group(size=cluster.world_size, ranks_per_host=cluster.ranks_per_host)
    slowest = cluster.inter_cost() if group.hosts > 1 else cluster.intra_cost()
    return lp.block_bytes(collective, nbytes, group.size, slowest, profile_of(cluster))


def _hierarchical(
    collective: str, n: int, group: Group, intra: C.LinkCost, inter: C.LinkCost
) -> Demand:
    """Inside each host, across hosts with 1/L of the data (L groups share each host link),
    inside again (``collectives/hierarchical.py``); chunk pipelining is left out."""
    local, hosts = group.ranks_per_host, group.hosts
    if local <= 1 or hosts <= 1 or collective not in ("all_reduce", "broadcast"):
        raise ValueError(
            f"hierarchical {collective} needs a group spanning several hosts with several ranks "
            f"each (got {hosts} host(s) x {local} rank(s)); pick a flat algorithm"
        )
    shared = _with_beta(inter, local * group.groups_per_host)
    if collective == "all_reduce":
        rs = _split(C.ring_reduce_scatter, n, local, intra)
        across = _split(C.ring_all_reduce, math.ceil(n / local), hosts, shared)
        ag = _split(C.ring_all_gather, n, local, intra)
        latency = rs[0] + across[0] + ag[0]
        total = rs[1] + ag[1] + across[1]
        return Demand(latency_s=latency, busy_s={"intra": total, "nic": total})
    lp = _split(C.lp_broadcast, n, hosts, inter)
    tree = _split(C.mst_broadcast, n, local, intra)
    total = lp[1] + tree[1]
    return Demand(latency_s=lp[0] + tree[0], busy_s={"intra": total, "nic": total})


def collective_time_s(
    collective: str, algo: str, nbytes: int, cluster: ClusterModel, group: Group | None = None
) -> float:
    """Seconds of one collective on an idle network (the whole world unless ``group``)."""
    group = group or Group(size=cluster.world_size, ranks_per_host=cluster.ranks_per_host)
    return demand(collective, algo, nbytes, group, cluster).idle_s

"""Pick the fastest algorithm for a message: calibrate alpha, beta, gamma, then minimise the
cost models of ``cost.py``.

Calibration (``calibrate``) measures, with the communicator's own point-to-point path (so the
Python overhead of our algorithms is priced in):

1. alpha and beta inside a host: a ping-pong between two ranks of host 0, at a tiny and a large
   size; alpha = half the tiny round trip, beta = the slope between the two sizes;
2. the same across hosts: rank 0 and the first rank of host 1 (where there is a second host);
3. gamma: the time of an in-place add over a large buffer, per byte.

Rank 0 measures and broadcasts the result, so every rank holds the *same* profile: selection
must agree on all ranks, or they would run different algorithms and deadlock. For the same
reason ``choose`` never looks at anything rank-local. Without a profile it uses defaults from
the link rate the launcher exports (COMMFUSE_LINK_MBIT), identical on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from commfuse.collectives import cost as C
from commfuse.collectives.registry import algorithms_for
from commfuse.comm import Communicator


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """Measured link costs of a cluster layout; saved as JSON by ``commfuse tune``."""

    intra: C.LinkCost
    """Between ranks of one host (loopback)."""
    inter: C.LinkCost
    """Between ranks of different hosts (the shaped links); equals intra on one host."""
    num_hosts: int = 1
    ranks_per_host: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        return cls(
            intra=C.LinkCost(**data["intra"]),
            inter=C.LinkCost(**data["inter"]),
            num_hosts=int(data.get("num_hosts", 1)),
            ranks_per_host=int(data.get("ranks_per_host", 1)),
        )

    @classmethod
    def default(cls, world_size: int) -> Profile:
        """From the launcher's environment: link rate and host layout (same on every rank)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)) or world_size)
        local = local if local >= 1 and world_size % local == 0 else world_size
        link = os.environ.get("COMMFUSE_LINK_MBIT")
        # Loopback between processes moves about 1 GB/s with gloo (DESIGN.md).
        intra = C.LinkCost(alpha_s=60e-6, beta_s_per_byte=1.0 / 1.0e9)
        inter = C.LinkCost.from_link_gbit(float(link) / 1000.0) if link else intra
        return cls(intra=intra, inter=inter, num_hosts=world_size // local, ranks_per_host=local)


_PROFILES: weakref.WeakKeyDictionary[Communicator, Profile] = weakref.WeakKeyDictionary()


def set_profile(comm: Communicator, profile: Profile) -> None:
    """Use ``profile`` for this communicator's ``algo="auto"`` choices (all ranks, same one)."""
    _PROFILES[comm] = profile


def profile_of(comm: Communicator) -> Profile:
    profile = _PROFILES.get(comm)
    if profile is None:
        path = os.environ.get("COMMFUSE_TUNER_PROFILE")
        profile = (
            Profile.from_json(Path(path).read_text()) if path else Profile.default(comm.world_size)
        )
        _PROFILES[comm] = profile
    return profile


# -- cost of each (collective, algorithm) ---------------------------------------------------------

CostFn = Callable[[int, int, Profile], float]


def _flat(profile: Profile) -> C.LinkCost:
    """A flat algorithm's messages cross host links whenever there is more than one host."""
    return profile.inter if profile.num_hosts > 1 else profile.intra


def _hier_allreduce(n: int, p: int, prof: Profile) -> float:
    local, hosts = prof.ranks_per_host, prof.num_hosts
    if local <= 1 or hosts <= 1:
        return float("inf")
    return (
        C.mst_reduce(n, local, prof.intra)
        + C.ring_allreduce(n, hosts, prof.inter)
        + C.mst_broadcast(n, local, prof.intra)
    )


def _hier_broadcast(n: int, p: int, prof: Profile) -> float:
    local, hosts = prof.ranks_per_host, prof.num_hosts
    if local <= 1 or hosts <= 1:
        return float("inf")
    return C.lp_broadcast(n, hosts, prof.inter) + C.mst_broadcast(n, local, prof.intra)


COSTS: dict[tuple[str, str], CostFn] = {
    ("allreduce", "native"): lambda n, p, pr: C.ring_allreduce(n, p, _flat(pr)),
    ("allreduce", "ring"): lambda n, p, pr: C.ring_allreduce(n, p, _flat(pr)),
    ("allreduce", "pipeline"): lambda n, p, pr: C.lp_allreduce(n, p, _flat(pr)),
    ("allreduce", "doubling"): lambda n, p, pr: C.recursive_doubling_allreduce(n, p, _flat(pr)),
    ("allreduce", "rabenseifner"): lambda n, p, pr: C.rabenseifner_allreduce(n, p, _flat(pr)),
    ("allreduce", "hierarchical"): _hier_allreduce,
    ("broadcast", "native"): lambda n, p, pr: C.mst_broadcast(n, p, _flat(pr)),
    ("broadcast", "tree"): lambda n, p, pr: C.mst_broadcast(n, p, _flat(pr)),
    ("broadcast", "pipeline"): lambda n, p, pr: C.lp_broadcast(n, p, _flat(pr)),
    ("broadcast", "hierarchical"): _hier_broadcast,
    ("reduce", "native"): lambda n, p, pr: C.mst_reduce(n, p, _flat(pr)),
    ("reduce", "tree"): lambda n, p, pr: C.mst_reduce(n, p, _flat(pr)),
    ("reduce", "pipeline"): lambda n, p, pr: C.lp_reduce(n, p, _flat(pr)),
    ("allgather", "native"): lambda n, p, pr: C.ring_allgather(n, p, _flat(pr)),
    ("allgather", "ring"): lambda n, p, pr: C.ring_allgather(n, p, _flat(pr)),
    ("allgather", "doubling"): lambda n, p, pr: C.recursive_doubling_allgather(n, p, _flat(pr)),
    # gloo's reduce-scatter is an allreduce followed by a slice (DESIGN.md).
    ("reduce_scatter", "native"): lambda n, p, pr: C.ring_allreduce(n, p, _flat(pr)),
    ("reduce_scatter", "ring"): lambda n, p, pr: C.ring_reduce_scatter(n, p, _flat(pr)),
    ("reduce_scatter", "halving"): lambda n, p, pr: (
        C.ring_reduce_scatter(n, p, _flat(pr)) - (p - 1 - C._lg(p)) * _flat(pr).alpha_s
    ),
    ("all_to_all", "native"): lambda n, p, pr: C.pairwise_all_to_all(n, p, _flat(pr)),
    ("all_to_all", "pairwise"): lambda n, p, pr: C.pairwise_all_to_all(n, p, _flat(pr)),
}


def predict(collective: str, algo: str, nbytes: int, world_size: int, profile: Profile) -> float:
    """Predicted seconds of one call; inf for an algorithm without a model here."""
    model = COSTS.get((collective, algo))
    return float("inf") if model is None else model(nbytes, world_size, profile)


def rank_algorithms(
    collective: str, nbytes: int, world_size: int, profile: Profile
) -> list[tuple[float, str]]:
    """(predicted seconds, name) of every registered algorithm, fastest first; ties keep
    registration order with native first, so the choice is deterministic."""
    names = list(algorithms_for(collective))
    names.sort(key=lambda name: (name != "native", name))
    return sorted(
        ((predict(collective, name, nbytes, world_size, profile), name) for name in names),
        key=lambda pair: pair[0],
    )


def choose(comm: Communicator, collective: str, nbytes: int) -> str:
    """The algorithm with the lowest predicted time (the same on every rank)."""
    ranked = rank_algorithms(collective, nbytes, comm.world_size, profile_of(comm))
    return ranked[0][1] if ranked and ranked[0][0] != float("inf") else "native"


# -- calibration --------------------------------------------------------------------------------------

_SMALL_BYTES = 8
_LARGE_BYTES = 4 << 20


def _ping_pong(comm: Communicator, a: int, b: int, nbytes: int, reps: int) -> float:
    """Median one-way time between group ranks a and b (other ranks return 0)."""
    buf = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(reps):
        if comm.rank == a:
            start = time.perf_counter()
            comm.send(buf, b, label="tune")
            comm.recv(buf, b, label="tune")
            times.append((time.perf_counter() - start) / 2)
        elif comm.rank == b:
            comm.recv(buf, a, label="tune")
            comm.send(buf, a, label="tune")
    return statistics.median(times) if times else 0.0


def _link_between(comm: Communicator, a: int, b: int, gamma: float) -> C.LinkCost:
    small = _ping_pong(comm, a, b, _SMALL_BYTES, reps=20)
    large = _ping_pong(comm, a, b, _LARGE_BYTES, reps=4)
    beta = max((large - small) / (_LARGE_BYTES - _SMALL_BYTES), 1e-12)
    return C.LinkCost(alpha_s=max(small, 1e-7), beta_s_per_byte=beta, gamma_s_per_byte=gamma)


def _measure_gamma() -> float:
    acc = torch.zeros(_LARGE_BYTES // 4)
    other = torch.ones_like(acc)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        acc.add_(other)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / _LARGE_BYTES


def calibrate(comm: Communicator, ranks_per_host: int | None = None) -> Profile:
    """Measure intra- and inter-host alpha/beta and gamma; every rank returns rank 0's profile."""
    world = comm.world_size
    local = ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        local = world
    hosts = world // local
    gamma = _measure_gamma()
    values = torch.zeros(6, dtype=torch.float64)
    if world > 1:
        intra = _link_between(comm, 0, 1, gamma) if local > 1 else None
        inter = _link_between(comm, 0, local, gamma) if hosts > 1 else None
        if comm.rank == 0:
            intra = intra or inter
            inter = inter or intra
            assert intra is not None and inter is not None
            values[:] = torch.tensor(
                [
                    intra.alpha_s,
                    intra.beta_s_per_byte,
                    inter.alpha_s,
                    inter.beta_s_per_byte,
                    gamma,
                    0.0,
                ]
            )
        comm.broadcast(values, 0)
    else:
        values[:] = torch.tensor([1e-7, 1e-12, 1e-7, 1e-12, gamma, 0.0])
    a_in, b_in, a_out, b_out, g, _ = values.tolist()
    return Profile(
        intra=C.LinkCost(alpha_s=a_in, beta_s_per_byte=b_in, gamma_s_per_byte=g),
        inter=C.LinkCost(alpha_s=a_out, beta_s_per_byte=b_out, gamma_s_per_byte=g),
        num_hosts=hosts,
        ranks_per_host=local,
    )

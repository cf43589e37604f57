"""Alpha-beta-gamma cost models of every algorithm, and nccl-tests' bus-bandwidth factors.

The Hockney model prices a message of n bytes at ``alpha + n * beta`` (alpha: start-up latency,
beta: seconds per byte, i.e. 1 / bandwidth) and a local reduction of n bytes at ``n * gamma``.
The formulas below (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005; Wang et al., "Efficient Communications in Training Large
Scale Neural Networks", arXiv 1611.04255) give each algorithm's time for P ranks and an n-byte
message. The tuner evaluates them with measured parameters and picks the smallest.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkCost:
    """Hockney parameters of one kind of link."""

    alpha_s: float = 50e-6
    """Start-up latency per message, seconds."""
    beta_s_per_byte: float = 1.0 / 1e9
    """Transfer time per byte, seconds (1 / bandwidth)."""
    gamma_s_per_byte: float = 0.25e-9
    """Local reduction time per byte, seconds."""

    @classmethod
    def from_link_gbit(
        cls, link_gbit: float, *, alpha_s: float = 100e-6, gamma_s_per_byte: float = 0.25e-9
    ) -> LinkCost:
        return cls(
            alpha_s=alpha_s,
            beta_s_per_byte=8.0 / (link_gbit * 1e9),
            gamma_s_per_byte=gamma_s_per_byte,
        )


#: The cost of one block step of the linear pipeline beyond its bytes, for the default block
#: size: a block costs a Python-level isend/irecv pair, gloo's handshake and a wake-up of the
#: forwarding rank, far more than the wire's latency. ``commfuse tune`` fits it per collective
#: (``Profile.pipeline_alpha_s``); untuned, this value, which sized blocks near the best of a
#: sweep of block sizes (``benchmarks/broadcast-pipeline_netlab-2to8x1gbit-2core.md``).
PIPELINE_BLOCK_ALPHA_S = 0.5e-3

#: Default chunk bytes per rank of the hierarchical all-reduce's group: a chunk's ring steps move
#: blocks of this size across hosts, so every chunk pays its steps' latency on the same amount of
#: data (``collectives/hierarchical.py``, Tuning).
HIERARCHICAL_CHUNK_BYTES_PER_RANK = 512 << 10
#: Upper bound of the hierarchical all-reduce's default chunk count.
HIERARCHICAL_MAX_CHUNKS = 64


def _lg(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def lp_best_block_bytes(n_bytes: int, world: int, cost: LinkCost, *, min_bytes: int = 4096) -> int:
    """Block size minimising the LP broadcast cost (P - 1 + n/b)(alpha + b beta):
    b* = sqrt(n alpha / ((P - 1) beta)), clamped to [min_bytes, n]."""
    if world <= 1 or n_bytes <= 0:
        return max(n_bytes, 1)
    best = math.sqrt(n_bytes * cost.alpha_s / ((world - 1) * cost.beta_s_per_byte))
    return int(min(max(best, min_bytes), n_bytes))


def lp_broadcast(n: int, p: int, c: LinkCost, block_bytes: int | None = None) -> float:
    """Linear pipeline along a chain: (P - 1 + n/b)(alpha + b beta)."""
    if p <= 1:
        return 0.0
    b = block_bytes or lp_best_block_bytes(n, p, c)
    return (p - 1 + math.ceil(n / b)) * (c.alpha_s + b * c.beta_s_per_byte)


def lp_reduce(n: int, p: int, c: LinkCost, block_bytes: int | None = None) -> float:
    """Pipelined reduce along a chain: the broadcast cost plus a reduction per block per hop."""
    if p <= 1:
        return 0.0
    b = block_bytes or lp_best_block_bytes(n, p, c)
    return (p - 1 + math.ceil(n / b)) * (c.alpha_s + b * (c.beta_s_per_byte + c.gamma_s_per_byte))


def lp_all_reduce(n: int, p: int, c: LinkCost, block_bytes: int | None = None) -> float:
    """Pipelined reduce then broadcast, overlapped: about one reduce plus P - 1 more block steps.

    This holds for a chain of separate links. Where each rank has one link (one NIC per host,
    as on netlab's emulated hosts), see ``lp_all_reduce_one_link``."""
    if p <= 1:
        return 0.0
    b = block_bytes or lp_best_block_bytes(n, p, c)
    return lp_reduce(n, p, c, b) + (p - 1) * (c.alpha_s + b * c.beta_s_per_byte)


def lp_all_reduce_one_link(n: int, p: int, c: LinkCost, block_bytes: int | None = None) -> float:
    """LP all-reduce when each rank's two outgoing streams share its one link: a middle rank
    sends partial block i toward the head and finished block j away from it in the same step,
    so its link carries 2n bytes, not n. With P = 2 each end sends one stream only.
    ``(2(P - 1) + n/b)(alpha + 2 b beta) + n gamma``."""
    if p <= 2:
        return lp_all_reduce(n, p, c, block_bytes)
    b = block_bytes or lp_best_block_bytes(n, p, c)
    steps = 2 * (p - 1) + math.ceil(n / b)
    return steps * (c.alpha_s + 2 * b * c.beta_s_per_byte) + n * c.gamma_s_per_byte


def mst_broadcast(n: int, p: int, c: LinkCost) -> float:
    """Binomial tree: ceil(lg P)(alpha + n beta)."""
    return _lg(p) * (c.alpha_s + n * c.beta_s_per_byte)


def gloo_broadcast(n: int, p: int, c: LinkCost) -> float:
    """gloo's broadcast (``gloo/broadcast.cc``): a binomial tree in which a rank that holds the
    data posts its sends to all its children at once, so they share its link. The root's
    L = ceil(lg P) children all finish after L n beta; the first of them then feeds its L - 1
    children, and so on down the deepest chain (virtual ranks 0, 1, 3, 7, ...):
    L alpha + L(L + 1)/2 n beta. For 4 ranks, 3 n beta, against a sequential tree's 2 n beta."""
    levels = _lg(p)
    return levels * c.alpha_s + levels * (levels + 1) / 2 * n * c.beta_s_per_byte


def gloo_broadcast_burst_bytes(n: int, p: int, burst_bytes: float) -> float:
    """Bytes of ``gloo_broadcast``'s deepest chain that pass at once on links shaped by token
    buckets of ``burst_bytes`` (netlab's tbf): each of its L hops leaves from another host, whose
    bucket is full, and the k-th hop from the end carries k n bytes on its link."""
    return float(sum(min(burst_bytes, k * n) for k in range(1, _lg(p) + 1)))


def mst_reduce(n: int, p: int, c: LinkCost) -> float:
    return _lg(p) * (c.alpha_s + n * (c.beta_s_per_byte + c.gamma_s_per_byte))


def ring_all_reduce(n: int, p: int, c: LinkCost) -> float:
    """2(P-1) alpha + 2((P-1)/P) n beta + ((P-1)/P) n gamma."""
    if p <= 1:
        return 0.0
    f = (p - 1) / p
    return 2 * (p - 1) * c.alpha_s + 2 * f * n * c.beta_s_per_byte + f * n * c.gamma_s_per_byte


def ring_reduce_scatter(n: int, p: int, c: LinkCost) -> float:
    """n is the full input: (P-1) alpha + ((P-1)/P) n (beta + gamma)."""
    if p <= 1:
        return 0.0
    f = (p - 1) / p
    return (p - 1) * c.alpha_s + f * n * (c.beta_s_per_byte + c.gamma_s_per_byte)


def ring_all_gather(n: int, p: int, c: LinkCost) -> float:
    """n is the full output: (P-1) alpha + ((P-1)/P) n beta."""
    if p <= 1:
        return 0.0
    return (p - 1) * c.alpha_s + (p - 1) / p * n * c.beta_s_per_byte


def recursive_doubling_all_reduce(n: int, p: int, c: LinkCost) -> float:
    """lg P (alpha + n beta + n gamma), plus two extra steps when P is not a power of two."""
    extra = 0 if p & (p - 1) == 0 else 2
    return (_lg(p) - (1 if extra else 0) + extra) * (c.alpha_s + n * c.beta_s_per_byte) + _lg(
        p
    ) * n * c.gamma_s_per_byte


def recursive_doubling_all_gather(n: int, p: int, c: LinkCost) -> float:
    """n is the full output: lg P alpha + ((P-1)/P) n beta."""
    if p <= 1:
        return 0.0
    return _lg(p) * c.alpha_s + (p - 1) / p * n * c.beta_s_per_byte


def rabenseifner_all_reduce(n: int, p: int, c: LinkCost) -> float:
    """2 lg P alpha + 2((P-1)/P) n beta + ((P-1)/P) n gamma (+ a fold for non-powers of two)."""
    if p <= 1:
        return 0.0
    f = (p - 1) / p
    fold = 0.0 if p & (p - 1) == 0 else 2 * (c.alpha_s + n * c.beta_s_per_byte)
    return (
        2 * _lg(p) * c.alpha_s + 2 * f * n * c.beta_s_per_byte + f * n * c.gamma_s_per_byte + fold
    )


def pairwise_all_to_all(n: int, p: int, c: LinkCost) -> float:
    """n is the full per-rank buffer: (P-1)(alpha + (n/P) beta)."""
    if p <= 1:
        return 0.0
    return (p - 1) * (c.alpha_s + n / p * c.beta_s_per_byte)


def hierarchical_num_chunks(n_bytes: int, world_size: int) -> int:
    """The hierarchical all-reduce's default chunk count: chunks of at most ``world_size x
    HIERARCHICAL_CHUNK_BYTES_PER_RANK`` bytes, between 1 and ``HIERARCHICAL_MAX_CHUNKS``."""
    per_chunk = world_size * HIERARCHICAL_CHUNK_BYTES_PER_RANK
    return max(1, min(HIERARCHICAL_MAX_CHUNKS, math.ceil(n_bytes / per_chunk)))


def hierarchical_all_reduce(
    n: int, num_hosts: int, ranks_per_host: int, intra: LinkCost, inter: LinkCost
) -> float:
    """The pipelined 2D all-reduce over ``num_hosts`` hosts of ``ranks_per_host`` ranks
    (``collectives/hierarchical.py``), in ``C = hierarchical_num_chunks`` chunks of m = n / C
    bytes, the L = ``ranks_per_host`` cross-host rings sharing each host link (beta_e x L):
    ``rs + x + ag + (C - 1) max(x, rs + ag)`` with ``rs``, ``ag`` the host rings' reduce-scatter
    and all-gather of m and ``x`` the cross-host ring all-reduce of m / L; inf when there is only
    one level."""
    hosts, local = num_hosts, ranks_per_host
    if local <= 1 or hosts <= 1:
        return math.inf
    chunks = hierarchical_num_chunks(n, hosts * local)
    m = math.ceil(n / chunks)
    shared = dataclasses.replace(inter, beta_s_per_byte=inter.beta_s_per_byte * local)
    rs = ring_reduce_scatter(m, local, intra)
    ag = ring_all_gather(m, local, intra)
    across = ring_all_reduce(math.ceil(m / local), hosts, shared)
    return rs + across + ag + (chunks - 1) * max(across, rs + ag)


def all_reduce_lower_bound(n: int, p: int, bandwidth_bytes_per_s: float) -> float:
    """No algorithm without in-network reduction beats 2((P-1)/P) n / B."""
    return 2 * (p - 1) / p * n / bandwidth_bytes_per_s if p > 1 else 0.0


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")

"""The linear pipeline (``collectives/pipeline.py``) as it runs, not as its textbook formula.

Block size. Called with ``algo="pipeline"`` and no ``block_bytes``, the code cuts blocks of
``lp_best_block_bytes(n, depth + 1, link)`` bytes (whole fp32 elements), ``link`` being the
launcher's link rate with ``PIPELINE_BLOCK_ALPHA_S`` per block and ``depth`` the hops
its chain must fill: ``P - 1`` for broadcast and reduce, ``2(P - 1)`` for allreduce (its reduce
goes up the chain and its broadcast comes back). ``block_bytes`` does the same with the
cluster's host-link rate; where a ``commfuse tune`` profile fitted a per-block cost, the tuner's
``best_block_bytes`` (what tuned dispatch passes) is used instead.

Price. The textbook cost ``(P - 1 + n/b)(alpha + b beta)`` (Wang et al., arXiv 1611.04255) is
a synchronous schedule in which every step pays alpha then moves a block. The code keeps
receives posted ahead and sends asynchronously, so a block's per-message cost (alpha: Python,
gloo's handshake, a wake-up) runs while earlier blocks are on the wire: in the steady state a
step costs ``max(alpha + b gamma, blocks-per-step x b beta)``, and only filling the chain pays
alpha and beta in series. On netlab each host link also has a token bucket (``inter_burst_kbyte``)
that lets a block up to its size through an idle link at once, so filling hops are nearly free:
a pipelined broadcast then takes little more than its bytes on the wire.

* broadcast, reduce: fill ``(P - 1)`` hops; the busiest link carries ``n`` bytes;
* allreduce, ``P > 2``: a middle rank's one link carries the partial blocks toward the head and
  the finished ones away from it, ``2n`` bytes (``cost.lp_all_reduce_one_link``), two blocks per
  step; the rank next to the head waits ``P - 2`` hops for its first partial block and its last
  finished block needs ``P - 2`` more hops to reach the chain's end. With ``P = 2`` each end
  sends one stream of ``n`` bytes, one hop behind the other.
"""

from __future__ import annotations

import math

from commfuse.collectives import cost as C
from commfuse.collectives.profile import Profile
from commfuse.collectives.tuner import best_block_bytes

_FP32_BYTES = 4


def block_bytes(collective: str, nbytes: int, p: int, link: C.LinkCost, profile: Profile) -> int:
    """The block the pipeline cuts ``nbytes`` into on ``p`` ranks over ``link`` (docstring)."""
    if collective in profile.pipeline_alpha_s:
        return best_block_bytes(collective, nbytes, p, profile)
    depth = 2 * (p - 1) if collective == "all_reduce" else p - 1
    code_link = C.LinkCost(alpha_s=C.PIPELINE_BLOCK_ALPHA_S, beta_s_per_byte=link.beta_s_per_byte)
    best = C.lp_best_block_bytes(nbytes, depth + 1, code_link)
    return max(1, best // _FP32_BYTES) * _FP32_BYTES


def pipeline_cost(
    collective: str,
    n: int,
    p: int,
    block: int,
    *,
    alpha_s: float,
    gamma_s_per_byte: float,
    beta_by_resource: dict[str, float],
    burst_by_resource: dict[str, float],
    slowest: str,
) -> tuple[float, dict[str, float]]:
    """(latency seconds, busy seconds per resource) of one pipelined collective (docstring).
    ``beta_by_resource``: seconds per byte of each resource the chain crosses, already shared
    among the groups using it; ``slowest``: the resource whose beta paces a step."""
    if collective not in ("broadcast", "reduce", "all_reduce"):
        raise ValueError(f"no linear pipeline for {collective!r}")
    if p <= 1 or n <= 0:
        return 0.0, {}
    b = min(block, n)
    k = math.ceil(n / b)
    gamma = 0.0 if collective == "broadcast" else gamma_s_per_byte
    cpu = alpha_s + b * gamma  # one block's per-message and reduction work
    two_streams = collective == "all_reduce" and p > 2
    per_step = 2 if two_streams else 1
    wire = per_step * b * beta_by_resource[slowest]
    if two_streams:
        fill_hops, link_bytes = 2 * (p - 2), 2 * n
    elif collective == "all_reduce":  # P = 2: the finished stream runs one hop behind
        fill_hops, link_bytes = 2, n
    else:
        fill_hops, link_bytes = p - 1, n
    # The last hop of a fill moves bytes the link's own stream already counts.
    extra_hops = fill_hops - 1 if not two_streams else fill_hops
    busy = {
        r: (link_bytes + extra_hops * max(0.0, b - burst_by_resource.get(r, 0.0))) * beta
        for r, beta in beta_by_resource.items()
    }
    latency = fill_hops * cpu + (k - 1) * max(0.0, cpu - wire)
    return latency, busy

"""Pick the fastest algorithm for a message: calibrate alpha, beta, gamma, measure every algorithm
at a few sizes, correct the cost models of ``cost.py`` with what was measured, then minimise.

Selection must agree on all ranks, or they would run different algorithms and deadlock. So
rank 0's alpha/beta/gamma are broadcast, the measured table is made identical by a max over
ranks before anything is fitted, and ``choose`` reads nothing rank-local: only the profile
(identical everywhere), the message size and the group size. Without a profile it uses
defaults from ``CommConfig.link_mbit`` and ``ranks_per_host``, identical on every rank.
Predictions within ``profile.NEAR_TIE`` of native's, after adding their standard error, go to
native: a difference that small is within the noise of these measurements, and native is the
safe default.

The profile (link costs, the measured corrections, the uncalibrated rules) is ``profile.py``;
calibration, which measures it, is ``calibration.py``. Design notes: ``docs/collectives.md``,
"The tuner: why measure every algorithm, and the defaults".
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from commfuse.collectives import cost as C
from commfuse.collectives.profile import Profile, TunerState, profile_of
from commfuse.collectives.registry import Options

if TYPE_CHECKING:
    # Annotations only: the cost models and ``choose_for`` are arithmetic, which the simulator
    # uses without torch.
    from commfuse.comm import Communicator


# -- cost of each (collective, algorithm) ---------------------------------------------------------

_CostFn = Callable[[int, int, Profile], float]


def _flat(profile: Profile) -> C.LinkCost:
    """A flat algorithm's messages cross host links whenever there is more than one host."""
    return profile.inter if profile.num_hosts > 1 else profile.intra


#: The pipelines' cost as a function of the block size b, per collective.
_LP_MODELS: dict[str, Callable[[int, int, C.LinkCost, int | None], float]] = {
    "broadcast": C.lp_broadcast,
    "reduce": C.lp_reduce,
    # One link per rank: the reduce and broadcast streams share it (cost.lp_allreduce_one_link).
    "all_reduce": C.lp_all_reduce_one_link,
}
_MIN_BLOCK_BYTES = 4096


def _native(profile: Profile) -> C.LinkCost:
    """The link as the backend's own collectives see it: plus their software cost per step."""
    link = _flat(profile)
    return dataclasses.replace(link, alpha_s=link.alpha_s + profile.native_alpha_s)


def _soft(link: C.LinkCost, profile: Profile) -> C.LinkCost:
    """``link`` as commfuse's point-to-point algorithms see it: plus their cost per message."""
    return dataclasses.replace(link, alpha_s=link.alpha_s + profile.software_alpha_s)


def _pipeline_link(profile: Profile, collective: str) -> C.LinkCost:
    """The link as our pipeline sees it: the fitted per-block latency where there is one."""
    link = _soft(_flat(profile), profile)
    alpha = profile.pipeline_alpha_s.get(collective)
    return link if alpha is None else dataclasses.replace(link, alpha_s=alpha)


def pipeline_block_bytes(collective: str, nbytes: int, world_size: int, profile: Profile) -> int:
    """The block a pipeline runs with under ``algo="auto"``: ``best_block_bytes`` where the
    profile hands blocks out (``tuned_blocks``), else the pipeline's own default (its chain's
    depth, ``PIPELINE_BLOCK_ALPHA_S`` per block, the link's rate), so the model prices the run
    that happens."""
    if profile.tuned_blocks:
        return best_block_bytes(collective, nbytes, world_size, profile)
    depth = 2 * (world_size - 1) if collective == "all_reduce" else world_size - 1
    link = dataclasses.replace(_flat(profile), alpha_s=C.PIPELINE_BLOCK_ALPHA_S)
    return C.lp_best_block_bytes(nbytes, depth + 1, link)


def best_block_bytes(collective: str, nbytes: int, world_size: int, profile: Profile) -> int:
    """The pipeline block size with the lowest modelled time, among powers of two from 4 KiB
    and the whole message (the correction depends on the size only, so the model alone decides;
    powers of two keep blocks whole elements of every dtype). Ties go to the larger block:
    fewer messages, less Python overhead. Never above the largest block calibration ran with:
    past it the model alone would decide, and it credits big blocks too much (at 64 MB it put
    the all-reduce pipeline with 2 MB blocks 29% below what it took)."""
    model = _LP_MODELS[collective]
    link = _pipeline_link(profile, collective)
    fix = profile.correction(collective, "pipeline", world_size)
    limit = max(fix.block_bytes, default=0) if fix is not None else 0
    limit = limit if limit > 0 else max(nbytes, 1)
    candidates = [max(nbytes, 1)] if nbytes <= limit else []
    block = _MIN_BLOCK_BYTES
    while block < nbytes and block <= limit:
        candidates.append(block)
        block *= 2
    if not candidates:  # a limit below 4 KiB: whole messages were all calibration saw
        candidates = [limit]
    return min(candidates, key=lambda b: (model(nbytes, world_size, link, b), -b))


def _lp(collective: str) -> _CostFn:
    def cost(n: int, p: int, pr: Profile) -> float:
        link = _pipeline_link(pr, collective)
        return _LP_MODELS[collective](n, p, link, pipeline_block_bytes(collective, n, p, pr))

    return cost


def _hier_all_reduce(n: int, p: int, prof: Profile) -> float:
    local, hosts = prof.ranks_per_host, prof.num_hosts
    if local <= 1 or hosts <= 1:
        # One level: it only wraps a flat algorithm that is a candidate of its own. Timing the
        # same thing twice and keeping the faster is a bet on noise (at 512 KB on 4 hosts x 1
        # rank it beat its own ring by 19% in calibration, then lost 13% to native).
        return math.inf
    return C.hierarchical_all_reduce(
        n, hosts, local, _soft(prof.intra, prof), _soft(prof.inter, prof)
    )


def _hier_broadcast(n: int, p: int, prof: Profile) -> float:
    local, hosts = prof.ranks_per_host, prof.num_hosts
    if local <= 1 or hosts <= 1:
        return math.inf  # one level: a wrapper of the flat pipeline (see _hier_allreduce)
    return C.lp_broadcast(n, hosts, _soft(prof.inter, prof)) + C.mst_broadcast(
        n, local, _soft(prof.intra, prof)
    )


COSTS: dict[tuple[str, str], _CostFn] = {
    ("all_reduce", "native"): lambda n, p, pr: C.ring_all_reduce(n, p, _native(pr)),
    ("all_reduce", "ring"): lambda n, p, pr: C.ring_all_reduce(n, p, _soft(_flat(pr), pr)),
    ("all_reduce", "pipeline"): _lp("all_reduce"),
    ("all_reduce", "doubling"): lambda n, p, pr: C.recursive_doubling_all_reduce(
        n, p, _soft(_flat(pr), pr)
    ),
    ("all_reduce", "rabenseifner"): lambda n, p, pr: C.rabenseifner_all_reduce(
        n, p, _soft(_flat(pr), pr)
    ),
    ("all_reduce", "hierarchical"): _hier_all_reduce,
    ("broadcast", "native"): lambda n, p, pr: C.gloo_broadcast(n, p, _native(pr)),
    ("broadcast", "tree"): lambda n, p, pr: C.mst_broadcast(n, p, _soft(_flat(pr), pr)),
    ("broadcast", "pipeline"): _lp("broadcast"),
    ("broadcast", "hierarchical"): _hier_broadcast,
    ("reduce", "native"): lambda n, p, pr: C.mst_reduce(n, p, _native(pr)),
    ("reduce", "tree"): lambda n, p, pr: C.mst_reduce(n, p, _soft(_flat(pr), pr)),
    ("reduce", "pipeline"): _lp("reduce"),
    ("all_gather", "native"): lambda n, p, pr: C.ring_all_gather(n, p, _native(pr)),
    ("all_gather", "ring"): lambda n, p, pr: C.ring_all_gather(n, p, _soft(_flat(pr), pr)),
    ("all_gather", "doubling"): lambda n, p, pr: C.recursive_doubling_all_gather(
        n, p, _soft(_flat(pr), pr)
    ),
    # gloo's reduce-scatter is an all-reduce followed by a slice (docs/design.md, "gloo").
    ("reduce_scatter", "native"): lambda n, p, pr: C.ring_all_reduce(n, p, _native(pr)),
    ("reduce_scatter", "ring"): lambda n, p, pr: C.ring_reduce_scatter(n, p, _soft(_flat(pr), pr)),
    ("reduce_scatter", "halving"): lambda n, p, pr: (
        C.ring_reduce_scatter(n, p, _soft(_flat(pr), pr))
        - (p - 1 - C._lg(p)) * _soft(_flat(pr), pr).alpha_s
    ),
    ("all_to_all", "native"): lambda n, p, pr: C.pairwise_all_to_all(n, p, _native(pr)),
    ("all_to_all", "pairwise"): lambda n, p, pr: C.pairwise_all_to_all(n, p, _soft(_flat(pr), pr)),
}


def model_time(collective: str, algo: str, nbytes: int, world_size: int, profile: Profile) -> float:
    """The pure alpha-beta-gamma time of one call, before any correction; inf without a model."""
    model = COSTS.get((collective, algo))
    return math.inf if model is None else model(nbytes, world_size, profile)


def model_at_block(
    collective: str, algo: str, nbytes: int, world_size: int, profile: Profile, block: int
) -> float:
    """``model_time``, but a pipeline's at the block it really ran with (when known)."""
    if algo == "pipeline" and collective in _LP_MODELS and block > 0:
        return _LP_MODELS[collective](
            nbytes, world_size, _pipeline_link(profile, collective), block
        )
    return model_time(collective, algo, nbytes, world_size, profile)


def predict(collective: str, algo: str, nbytes: int, world_size: int, profile: Profile) -> float:
    """Predicted seconds of one call: the model times the measured correction where the profile
    has one for this group size; inf for an algorithm without a model here."""
    base = model_time(collective, algo, nbytes, world_size, profile)
    fix = profile.correction(collective, algo, world_size)
    return base if fix is None or base == math.inf else base * fix.ratio(nbytes)


def rank_algorithms(
    collective: str, nbytes: int, world_size: int, profile: Profile
) -> list[tuple[float, str]]:
    """(predicted seconds, name) of every registered algorithm, fastest first; equal times keep
    native first, then name order, so the ranking is deterministic."""
    # Every registered algorithm has a model in ``COSTS`` (a test holds the two sets equal), so
    # the names come from the models: choosing needs no algorithm's code, nor torch.
    names = sorted(
        (name for op, name in COSTS if op == collective), key=lambda name: (name != "native", name)
    )
    return sorted(
        ((predict(collective, name, nbytes, world_size, profile), name) for name in names),
        key=lambda pair: pair[0],
    )


def choose_for(collective: str, nbytes: int, world_size: int, profile: Profile) -> str:
    """``choose`` as a pure function: the fastest algorithm, unless native is within
    ``NEAR_TIE`` of it (or nothing has a finite prediction).

    Each prediction is taken at the upper end of its calibration's standard error first, so
    noise cannot make a tie look like a win: at 512 KB Rabenseifner's median ratio to native
    ranged from 0.97 to 1.12 over calibrations, and picking it on a 0.97 made auto 5% slower
    than native. Where an algorithm wins 2-5x, or runs agree within a few percent (large
    messages), the error changes nothing. ``predict`` itself stays unbiased."""
    cautious = []
    for predicted, name in rank_algorithms(collective, nbytes, world_size, profile):
        fix = profile.correction(collective, name, world_size)
        error = 0.0 if fix is None else fix.stderr_at(nbytes)
        cautious.append((predicted * (1.0 + error), name))
    cautious.sort(key=lambda pair: pair[0])  # stable: ties keep native first
    if not cautious or cautious[0][0] == math.inf:
        return "native"
    best_s, best = cautious[0]
    native_s = next((t for t, name in cautious if name == "native"), math.inf)
    return "native" if native_s <= best_s * (1.0 + profile.min_gain) else best


def options_for(
    collective: str, algo: str, nbytes: int, world_size: int, profile: Profile
) -> Options:
    """Keyword options that go with ``algo`` (pipelines: the modelled best ``block_bytes``, when
    the profile was calibrated with them)."""
    if algo == "pipeline" and collective in _LP_MODELS and world_size > 1 and profile.tuned_blocks:
        return {"block_bytes": best_block_bytes(collective, nbytes, world_size, profile)}
    return {}


def choose(comm: Communicator, collective: str, nbytes: int) -> str:
    """The algorithm with the lowest predicted time (the same on every rank), remembered per
    (collective, size) in the communicator's ``TunerState``."""
    profile = profile_of(comm)
    cache = comm.owned(TunerState).choices
    key = (collective, nbytes)
    if key not in cache:
        tried = profile.trial_choice(collective, nbytes, comm.world_size)
        cache[key] = tried or choose_for(collective, nbytes, comm.world_size, profile)
    return cache[key]


def remember_choice(comm: Communicator, collective: str, nbytes: int, algo: str) -> None:
    """Make ``algo`` the communicator's choice for this message from now on (a timed trial's
    decision, ``trial.py``; the same on every rank)."""
    comm.owned(TunerState).choices[(collective, nbytes)] = algo


def save_trial_choice(comm: Communicator, collective: str, nbytes: int, algo: str) -> None:
    """Keep a timed trial's decision in the profile, in memory and in
    ``CommConfig.tuner_profile_path`` when one is set, so the next job on this layout starts
    with it instead of trying again.

    A profile describes one layout (``num_hosts`` x ``ranks_per_host``): a decision made by a
    group of another size (a sub-communicator) stays in this process. The first rank of each
    host writes, so a profile on each host's own disk and one on a shared file system both get
    it; the file is re-read first, keeping what other jobs added, and replaced atomically, so a
    reader never sees half a file."""
    state = comm.owned(TunerState)
    profile = profile_of(comm)
    if profile.world_size != comm.world_size:
        return
    state.profile = _with_trial_choice(profile, collective, nbytes, algo)
    path_name = comm.config.tuner_profile_path
    if path_name is None or comm.rank % profile.ranks_per_host != 0:
        return
    path = Path(path_name)
    try:
        on_disk = Profile.from_json(path.read_text())
    except FileNotFoundError:
        on_disk = profile
    if on_disk.world_size != comm.world_size:  # another layout's job replaced it meanwhile
        return
    updated = _with_trial_choice(on_disk, collective, nbytes, algo)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(updated.to_json())
    os.replace(temporary, path)


def _with_trial_choice(profile: Profile, collective: str, nbytes: int, algo: str) -> Profile:
    choices = {name: dict(sizes) for name, sizes in profile.trial_choices.items()}
    choices.setdefault(collective, {})[nbytes] = algo
    return dataclasses.replace(profile, trial_choices=choices)


def choose_options(comm: Communicator, collective: str, algo: str, nbytes: int) -> Options:
    """The options ``algo="auto"`` runs ``algo`` with (the same on every rank); explicit options
    of the caller should override them (merge, never mutate: the dict is remembered)."""
    cache = comm.owned(TunerState).options
    key = (collective, algo, nbytes)
    if key not in cache:
        cache[key] = options_for(collective, algo, nbytes, comm.world_size, profile_of(comm))
    return cache[key]

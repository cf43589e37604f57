"""Calibration for the tuner: measure the cluster, then every algorithm, and fit the models.

1. alpha and beta inside a host and across hosts, from ping-pongs on the communicator's own
   point-to-point path (so our Python overhead is priced in), and gamma from a timed add;
2. every registered algorithm of every collective at ``CALIBRATION_SIZES``, timed round-robin
   across rows (a burst of load spoils one run of many rows, not every run of one row), max
   over ranks, each as a ratio to native measured in the same run;
3. per (collective, algorithm) a correction of its alpha-beta-gamma model (``profile.Correction``).

Rank 0's numbers are what every rank ends with, so all ranks hold the same profile and
``choose`` agrees everywhere. ``commfuse tune`` runs this and writes the profile JSON.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

import torch

from commfuse.collectives import cost as C
from commfuse.collectives.profile import (
    BLOCK_FIT_MAX_BYTES,
    BLOCK_FIT_MIN_BYTES,
    CALIBRATION_SIZES,
    SMALL_BYTES_MAX,
    SMALL_REPS_FACTOR,
    Corrections,
    Measurement,
    Profile,
    fit_correction,
)
from commfuse.collectives.registry import COLLECTIVES, Options, algorithms_for
from commfuse.collectives.tuner import _LP_MODELS, _flat, model_at_block, model_time, options_for
from commfuse.comm import Communicator
from commfuse.comm.clock import now

_SMALL_BYTES = 8
_LARGE_BYTES = 4 << 20


def _ping_pong(comm: Communicator, a: int, b: int, nbytes: int, reps: int) -> float:
    """Fastest one-way time between group ranks a and b (other ranks return 0). The fastest,
    not the median: with more ranks than cores, a tiny ping-pong can wait milliseconds for a
    core in most runs, and alpha is meant to be the link's latency; the corrections price in
    the waiting."""
    buf = torch.zeros(max(1, nbytes // 4), device=comm.device)
    times = []
    for _ in range(reps):
        if comm.rank == a:
            start = now(comm.device)
            comm.send(buf, b, label="tune")
            comm.recv(buf, b, label="tune")
            times.append((now(comm.device) - start) / 2)
        elif comm.rank == b:
            comm.recv(buf, a, label="tune")
            comm.send(buf, a, label="tune")
    return min(times) if times else 0.0


def _link_between(comm: Communicator, a: int, b: int, gamma: float) -> C.LinkCost:
    small = _ping_pong(comm, a, b, _SMALL_BYTES, reps=20)
    large = _ping_pong(comm, a, b, _LARGE_BYTES, reps=4)
    beta = max((large - small) / (_LARGE_BYTES - _SMALL_BYTES), 1e-12)
    return C.LinkCost(alpha_s=max(small, 1e-7), beta_s_per_byte=beta, gamma_s_per_byte=gamma)


def _measure_gamma(device: torch.device) -> float:
    acc = torch.zeros(_LARGE_BYTES // 4, device=device)
    other = torch.ones_like(acc)
    times = []
    for _ in range(5):
        start = now(device)
        acc.add_(other)
        times.append(now(device) - start)
    return statistics.median(times) / _LARGE_BYTES


def _calibrate_links(comm: Communicator, ranks_per_host: int | None) -> Profile:
    """Steps 1-3: alpha, beta, gamma; every rank returns rank 0's values."""
    world = comm.world_size
    local = ranks_per_host or comm.config.ranks_per_host or world
    if local < 1 or world % local:
        local = world
    hosts = world // local
    gamma = _measure_gamma(comm.device)
    values = torch.zeros(6, dtype=torch.float64, device=comm.device)
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
                ],
                device=comm.device,
            )
        comm.broadcast(values, 0)
    else:
        values[:] = torch.tensor([1e-7, 1e-12, 1e-7, 1e-12, gamma, 0.0], device=comm.device)
    a_in, b_in, a_out, b_out, g, _ = values.tolist()
    return Profile(
        intra=C.LinkCost(alpha_s=a_in, beta_s_per_byte=b_in, gamma_s_per_byte=g),
        inter=C.LinkCost(alpha_s=a_out, beta_s_per_byte=b_out, gamma_s_per_byte=g),
        num_hosts=hosts,
        ranks_per_host=local,
    )


def _call_of(
    comm: Communicator, collective: str, algo: str, nbytes: int, opts: Options
) -> Callable[[], object]:
    """One call of ``algo`` on an S = ``nbytes`` message (nccl-tests' S, as the front door
    measures it for ``choose``; a multiple of 4 x world size). Zeros in, so repeated in-place
    sums stay exact and cheap."""
    from commfuse.collectives import api

    world = comm.world_size
    elems = nbytes // 4
    if collective in ("all_reduce", "broadcast", "reduce"):
        buf = torch.zeros(elems, device=comm.device)
        if collective == "all_reduce":
            return lambda: api.all_reduce(comm, buf, "sum", algo=algo, **opts)
        if collective == "broadcast":
            return lambda: api.broadcast(comm, buf, 0, algo=algo, **opts)
        return lambda: api.reduce(comm, buf, 0, "sum", algo=algo, **opts)
    whole = torch.zeros(elems, device=comm.device)
    piece = torch.zeros(elems // world, device=comm.device)
    if collective == "all_gather":
        return lambda: api.all_gather(comm, whole, piece, algo=algo, **opts)
    if collective == "reduce_scatter":
        return lambda: api.reduce_scatter(comm, piece, whole, "sum", algo=algo, **opts)
    if collective == "all_to_all":
        other = torch.zeros_like(whole)
        return lambda: api.all_to_all(comm, other, whole, algo=algo, **opts)
    raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")


def measure_algorithms(
    comm: Communicator,
    profile: Profile,
    *,
    sizes_bytes: Sequence[int] = CALIBRATION_SIZES,
    collectives: Sequence[str] = COLLECTIVES,
    algos: Sequence[str] | None = None,
    reps: int = 5,
) -> list[Measurement]:
    """Step 4: (collective, algorithm, S bytes, seconds) for every registered algorithm (or
    those named in ``algos``) at every size; identical on every rank (max over ranks, then the median over ``reps`` runs, or
    ``SMALL_REPS_FACTOR`` times as many up to ``SMALL_BYTES_MAX``, paired with native's: see
    ``_paired_medians``).

    Run r of every (collective, size) comes before run r + 1 of any: the runs of one row are
    spread over the whole calibration, so a burst of load from elsewhere (these machines are
    shared) spoils one run of many rows, which the median drops, not every run of one row,
    which would mislead the choice there for good. Buffers are made afresh for each pass so
    that only one row's are alive at a time."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    world = comm.world_size
    rows: list[tuple[str, list[str], int, torch.Tensor]] = []
    for collective in collectives:
        names = sorted(algorithms_for(collective), key=lambda name: (name != "native", name))
        # Only what choose can pick: an algorithm without a model here is never chosen.
        names = [
            name
            for name in names
            if (algos is None or name in algos)
            and model_time(collective, name, 1 << 20, world, profile) < math.inf
        ]
        if not names:
            continue
        # Whole float32 elements and whole blocks of the world-sized buffers, smallest first.
        for nbytes in sorted({4 * world * max(1, size // (4 * world)) for size in sizes_bytes}):
            runs = reps * SMALL_REPS_FACTOR if nbytes <= SMALL_BYTES_MAX else reps
            times = torch.zeros(len(names), runs, dtype=torch.float64, device=comm.device)
            rows.append((collective, names, nbytes, times))

    def calls_of(collective: str, names: list[str], nbytes: int) -> list[Callable[[], object]]:
        return [
            _call_of(
                comm,
                collective,
                name,
                nbytes,
                options_for(collective, name, nbytes, world, profile),
            )
            for name in names
        ]

    # Warm up every algorithm once (connections, sub-groups, allocator), at the smallest size.
    warm: set[str] = set()
    for collective, names, nbytes, _ in rows:
        if collective not in warm:
            warm.add(collective)
            for call in calls_of(collective, names, nbytes):
                call()
    for rep in range(max((t.shape[1] for *_, t in rows), default=0)):
        for collective, names, nbytes, times in rows:
            if rep >= times.shape[1]:
                continue
            for i, call in enumerate(calls_of(collective, names, nbytes)):  # A B A B ...
                comm.barrier()
                start = now(comm.device)
                call()
                times[i, rep] = now(comm.device) - start
    table: list[Measurement] = []
    for collective, names, nbytes, times in rows:
        # A collective takes as long as its slowest rank; max is exact, so every rank holds
        # the same times and fits the same corrections.
        comm.all_reduce(times, "max")
        paired = _paired_medians(names, times.tolist())
        for name, (seconds, error) in zip(names, paired, strict=True):
            opts = options_for(collective, name, nbytes, world, profile)
            block = int(opts.get("block_bytes", 0))
            table.append(Measurement(collective, name, nbytes, seconds, block, error))
    return table


def _paired_medians(names: Sequence[str], runs: list[list[float]]) -> list[tuple[float, float]]:
    """(seconds, relative standard error) per algorithm: native's median times the median of
    the algorithm's ratio to native, paired run by run (runs r of all algorithms are back to
    back, so load that drifts between runs cancels out of the ratio, on which the choice
    hinges); the error is that of the median ratio, from its MAD."""
    if "native" not in names:
        return [(statistics.median(row), 0.0) for row in runs]
    native = runs[list(names).index("native")]
    base = statistics.median(native)
    out = []
    for name, row in zip(names, runs, strict=True):
        if name == "native":
            out.append((base, 0.0))
            continue
        ratios = [t / max(n, 1e-9) for t, n in zip(row, native, strict=True)]
        mid = statistics.median(ratios)
        spread = statistics.median(abs(r - mid) for r in ratios)
        # Standard error of a median from the MAD: 1.253 * 1.4826 * MAD / sqrt(n).
        out.append((base * mid, 1.858 * spread / math.sqrt(len(ratios)) / mid))
    return out


def fit_pipeline_alpha(
    measurements: Sequence[Measurement], world_size: int, profile: Profile
) -> dict[str, float]:
    """Per pipelined collective, the per-block latency that makes its model meet its runs from
    ``BLOCK_FIT_MIN_BYTES`` up (the median over sizes), never below the ping-pong's alpha.

    The model is linear in alpha, ``T = T0 + steps * alpha`` at a given block, so each run
    gives ``alpha = (T - T0) / steps``, with T0 and steps read off the model itself."""
    link = _flat(profile)
    fitted: dict[str, list[float]] = {}
    for m in measurements:
        if m.algo != "pipeline" or m.collective not in _LP_MODELS or m.block_bytes <= 0:
            continue
        if m.nbytes < BLOCK_FIT_MIN_BYTES:
            continue
        model = _LP_MODELS[m.collective]
        base = model(m.nbytes, world_size, dataclasses.replace(link, alpha_s=0.0), m.block_bytes)
        steps = model(m.nbytes, world_size, dataclasses.replace(link, alpha_s=1.0), m.block_bytes)
        if steps - base > 0:
            fitted.setdefault(m.collective, []).append((m.seconds - base) / (steps - base))
    return {c: max(link.alpha_s, statistics.median(v)) for c, v in sorted(fitted.items())}


def fit_corrections(
    measurements: Sequence[Measurement], world_size: int, profile: Profile
) -> Corrections:
    """Per (collective, algorithm), the correction through its measured points (a pipeline's
    model taken at the block each point ran with)."""
    grouped: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        grouped.setdefault((m.collective, m.algo), []).append(m)
    corrections: Corrections = {}
    for (collective, algo), points in grouped.items():
        fit = fit_correction(
            [m.nbytes for m in points],
            [
                model_at_block(collective, algo, m.nbytes, world_size, profile, m.block_bytes)
                for m in points
            ],
            [m.seconds for m in points],
            [m.block_bytes for m in points],
            [m.stderr for m in points],
        )
        if fit is not None:
            corrections.setdefault(collective, {})[algo] = fit
    return corrections


def calibrate(
    comm: Communicator,
    ranks_per_host: int | None = None,
    *,
    sizes_bytes: Sequence[int] = CALIBRATION_SIZES,
    reps: int = 5,
) -> Profile:
    """Measure alpha/beta/gamma, then every algorithm at ``sizes_bytes`` (none: skip) and fit
    the corrections; every rank returns the same profile.

    The front door runs auto's pipelines with the tuner's blocks, so the pipelines first run
    alone (blocks sized by the ping-pong's alpha, calibration sizes from
    ``BLOCK_FIT_MIN_BYTES`` to ``BLOCK_FIT_MAX_BYTES``) to fit their per-block latency, which
    sizes their blocks from then on. So the main pass times them with the very blocks
    ``algo="auto"`` will use: a block the tuner picks is one it has measured, never only
    modelled. Their corrections are taken against the model at those blocks."""
    profile = _calibrate_links(comm, ranks_per_host)
    world = comm.world_size
    if world == 1 or not sizes_bytes:
        return profile
    # The front door runs auto's pipelines with choose_options' blocks: time them with those.
    profile = dataclasses.replace(profile, tuned_blocks=True)
    fit_sizes = [s for s in sizes_bytes if BLOCK_FIT_MIN_BYTES <= s <= BLOCK_FIT_MAX_BYTES]
    if fit_sizes:
        first = measure_algorithms(
            comm,
            profile,
            sizes_bytes=fit_sizes,
            collectives=tuple(_LP_MODELS),
            algos=("pipeline",),
            reps=3,
        )
        profile = dataclasses.replace(
            profile, pipeline_alpha_s=fit_pipeline_alpha(first, world, profile)
        )
    measured = measure_algorithms(comm, profile, sizes_bytes=sizes_bytes, reps=reps)
    return dataclasses.replace(profile, corrections=fit_corrections(measured, world, profile))

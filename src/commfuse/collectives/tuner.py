"""Pick the fastest algorithm for a message: calibrate alpha, beta, gamma, measure every algorithm
at a few sizes, correct the cost models of ``cost.py`` with what was measured, then minimise.

Calibration (``calibrate``) runs on every rank of the cluster it describes:

1. alpha and beta inside a host: a ping-pong between two ranks of host 0, at a tiny and a large
   size; alpha = half the fastest tiny round trip, beta = the slope between the two sizes;
2. the same across hosts: rank 0 and the first rank of host 1 (where there is a second host);
3. gamma: the time of an in-place add over a large buffer, per byte;
4. the pipelines' real cost per block (``Profile.pipeline_alpha_s``), which sizes their blocks,
   where the front door passes the tuner's blocks on (``Profile.tuned_blocks``);
5. every registered algorithm that has a model here, through the front door (``api.py``) with
   the options ``choose_options`` gives it (the ones ``algo="auto"`` runs it with), at
   ``CALIBRATION_SIZES``: interleaved (A B A B), each run after a barrier, timed as the
   slowest rank (max over ranks), as ``commfuse bench collectives`` times them; native's
   median, and for the others native's median times their median ratio to native, run by run,
   with its standard error (``_paired_medians``).

Selection must agree on all ranks, or they would run different algorithms and deadlock. So
rank 0's alpha/beta/gamma are broadcast, the measured table is made identical by a max over
ranks before anything is fitted, and ``choose`` reads nothing rank-local: only the profile
(identical everywhere), the message size and the group size. Without a profile it uses
defaults from ``CommConfig.link_mbit`` and ``ranks_per_host``, identical on every rank.
Predictions within ``NEAR_TIE`` of native's, after adding their standard error, go to native:
a difference that small is within the noise of these measurements, and native is the safe
default.

Design notes: ``docs/collectives.md``, "The tuner: why measure every algorithm, and the defaults".
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from commfuse.collectives import cost as C
from commfuse.collectives.registry import COLLECTIVES, Options

if TYPE_CHECKING:
    # Annotations only: the cost models, the profile and ``choose_for`` are arithmetic, which
    # the simulator uses without torch.
    from commfuse.comm import Communicator

#: Message sizes (bytes, nccl-tests' S) that calibration times every algorithm at: every 4x, and
#: every 2x from 64 KB to 1 MB, where the pipeline, recursive doubling and gloo's ring hand over
#: to each other (interpolating over a wider gap there misplaced the hand-over).
CALIBRATION_SIZES: tuple[int, ...] = (
    4 << 10,
    16 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
)
#: Up to this size calibration times ``SMALL_REPS_FACTOR`` times as many runs: small messages cost
#: little, and their times can be bimodal (a scheduler delay in some of the runs when ranks
#: share cores), so a median of 5 can fall in either mode; near 1 MB several all-reduces are
#: close to each other.
SMALL_BYTES_MAX = 1 << 20
SMALL_REPS_FACTOR = 3
#: An algorithm must be predicted more than this much faster than native to be chosen.
NEAR_TIE = 0.02
#: Pipelines' per-block latency is fitted from a first pass over the calibration sizes in this
#: range: many blocks, no scheduler noise of small messages, and about 1 s in all.
BLOCK_FIT_MIN_BYTES = 1 << 20
BLOCK_FIT_MAX_BYTES = 4 << 20


class Measurement(NamedTuple):
    """One calibration point: the slowest rank's time, over runs (see ``_paired_medians``)."""

    collective: str
    algo: str
    nbytes: int
    seconds: float
    block_bytes: int = 0
    """The block a pipeline ran with (0 for other algorithms)."""
    stderr: float = 0.0
    """Standard error of its ratio to native's time, relative (0 for native)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Correction:
    """How one (collective, algorithm) really behaves next to its model, per calibration size.

    ``predicted(n) = model(n) * ratio(n)``, where ``ratio`` interpolates ``ratios`` linearly in
    log(n) between ``sizes_bytes`` and is held at the end values beyond them.
    """

    sizes_bytes: tuple[int, ...]
    """Calibration sizes, ascending."""
    ratios: tuple[float, ...]
    """Measured time / model time at each size."""
    measured_s: tuple[float, ...] = ()
    """The measured times (see ``_paired_medians``), for reports and refits."""
    block_bytes: tuple[int, ...] = ()
    """For pipelines, the block each calibration run used (the model is taken at that block)."""
    stderr: tuple[float, ...] = ()
    """Relative standard error of the measured ratio to native at each size (see ``choose``)."""

    def ratio(self, nbytes: int) -> float:
        return _interpolate(self.sizes_bytes, self.ratios, nbytes)

    def stderr_at(self, nbytes: int) -> float:
        if len(self.stderr) != len(self.sizes_bytes):
            return 0.0
        # Geometric interpolation needs positive values: interpolate 1 + stderr.
        return _interpolate(self.sizes_bytes, [1.0 + e for e in self.stderr], nbytes) - 1.0

    def leave_one_out_errors(self) -> list[float]:
        """For each size: (prediction from the other sizes) / measured - 1. The error the
        correction makes between calibration points, estimated from the points themselves."""
        errors = []
        for i, size in enumerate(self.sizes_bytes):
            rest = [j for j in range(len(self.sizes_bytes)) if j != i]
            if not rest:
                errors.append(0.0)
                continue
            guess = _interpolate(
                [self.sizes_bytes[j] for j in rest], [self.ratios[j] for j in rest], size
            )
            errors.append(guess / self.ratios[i] - 1.0)
        return errors


def _interpolate(sizes: Sequence[int], ratios: Sequence[float], nbytes: int) -> float:
    if not sizes:
        return 1.0
    if nbytes <= sizes[0]:
        return ratios[0]
    if nbytes >= sizes[-1]:
        return ratios[-1]
    i = bisect.bisect_right(sizes, nbytes) - 1
    x0, x1 = math.log(sizes[i]), math.log(sizes[i + 1])
    t = (math.log(nbytes) - x0) / (x1 - x0)
    return math.exp((1 - t) * math.log(ratios[i]) + t * math.log(ratios[i + 1]))


def fit_correction(
    sizes_bytes: Sequence[int],
    model_s: Sequence[float],
    measured_s: Sequence[float],
    block_bytes: Sequence[int] = (),
    stderr: Sequence[float] = (),
) -> Correction | None:
    """The correction through measured points; None when no point is usable (no finite,
    positive model or measurement). Repeated sizes are merged by their geometric mean ratio."""
    blocks = list(block_bytes) or [0] * len(sizes_bytes)
    errors = list(stderr) or [0.0] * len(sizes_bytes)
    by_size: dict[int, list[tuple[float, float, int, float]]] = {}
    points = zip(sizes_bytes, model_s, measured_s, blocks, errors, strict=True)
    for size, model, measured, block, error in points:
        if size > 0 and 0 < model < math.inf and 0 < measured < math.inf:
            by_size.setdefault(size, []).append((measured / model, measured, block, error))
    if not by_size:
        return None
    sizes = sorted(by_size)
    return Correction(
        sizes_bytes=tuple(sizes),
        ratios=tuple(math.exp(statistics.fmean(math.log(p[0]) for p in by_size[s])) for s in sizes),
        measured_s=tuple(statistics.median(p[1] for p in by_size[s]) for s in sizes),
        block_bytes=tuple(by_size[s][0][2] for s in sizes) if any(blocks) else (),
        stderr=tuple(max(p[3] for p in by_size[s]) for s in sizes) if any(errors) else (),
    )


Corrections = dict[str, dict[str, Correction]]
"""``corrections[collective][algorithm]``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """Measured link costs and model corrections of a cluster layout; saved as JSON by
    ``commfuse tune``. ``corrections`` is optional in the JSON (older profiles have none)."""

    intra: C.LinkCost
    """Between ranks of one host (loopback)."""
    inter: C.LinkCost
    """Between ranks of different hosts (the shaped links); equals intra on one host."""
    num_hosts: int = 1
    ranks_per_host: int = 1
    corrections: Corrections = dataclasses.field(default_factory=dict)
    """Per collective and algorithm, measured / model at the calibration sizes; they hold for a
    group of num_hosts x ranks_per_host ranks only."""
    tuned_blocks: bool = False
    """Whether ``algo="auto"`` runs pipelines with ``choose_options``' blocks: calibration times
    the pipelines with the blocks auto will run (the front door passes ``choose_options`` on),
    and sets it. When false (a profile without it) the pipelines were calibrated, and run, with
    their own default block, and no options are given."""
    pipeline_alpha_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per collective, our pipeline's cost per block beyond the bytes (Python, thread wake-ups,
    the reduction's bookkeeping), fitted from its calibration runs. A ping-pong's alpha is a
    fraction of it, and blocks sized by that alpha come out too small and slow. It sets the
    pipelines' block size and model."""
    native_alpha_s: float = 0.0
    """Software cost of one step of the backend's own collectives (gloo's C++ loop, its
    threads' wake-ups), seconds, added to the link's alpha in native's models. 0 in a
    calibrated profile: its corrections hold what the models leave out."""
    software_alpha_s: float = 0.0
    """Software cost of one message of commfuse's point-to-point algorithms (ring, doubling,
    Rabenseifner, halving, tree, pairwise, hierarchical; the pipelines where
    ``pipeline_alpha_s`` has no entry), seconds, added to the link's alpha in their models: a
    Python isend/irecv and wait, gloo's pair handshake, a wake-up of the receiving rank, far
    more than native's per step. 0 in a calibrated profile (see ``native_alpha_s``)."""
    min_gain: float = NEAR_TIE
    """How much faster than native an algorithm must be predicted (after its standard error)
    to be chosen: 0.02 means 2%. A calibrated profile measured the algorithms and keeps
    ``NEAR_TIE``; the uncalibrated one asks for ``UNCALIBRATED_MIN_GAIN``."""
    trial_choices: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    """``trial_choices[collective][nbytes]``: the algorithm a timed trial at first use chose for
    that message on this layout (``trial.py``). ``algo="auto"`` takes it as it stands, before
    any model, and runs no new trial for it: a measurement on the job itself beats a
    prediction."""

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def correction(self, collective: str, algo: str, world_size: int) -> Correction | None:
        if world_size != self.world_size:
            return None
        return self.corrections.get(collective, {}).get(algo)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """The profile ``to_json`` wrote. ValueError for a collective outside ``COLLECTIVES``
        (``allreduce`` where ``all_reduce`` is meant): measure a new one with ``commfuse tune``."""
        data = json.loads(text)
        unknown = sorted(set(data.get("corrections", {})) - set(COLLECTIVES))
        unknown += sorted(set(data.get("pipeline_alpha_s", {})) - set(COLLECTIVES))
        unknown += sorted(set(data.get("trial_choices", {})) - set(COLLECTIVES))
        if unknown:
            raise ValueError(
                f"tuner profile names unknown collectives {', '.join(unknown)} (known: "
                f"{', '.join(COLLECTIVES)}); measure a new profile with `commfuse tune`"
            )
        trial_choices = {
            collective: {int(nbytes): str(algo) for nbytes, algo in sizes.items()}
            for collective, sizes in data.get("trial_choices", {}).items()
        }
        corrections: Corrections = {
            collective: {
                algo: Correction(
                    sizes_bytes=tuple(int(s) for s in fit["sizes_bytes"]),
                    ratios=tuple(float(r) for r in fit["ratios"]),
                    measured_s=tuple(float(m) for m in fit.get("measured_s", ())),
                    block_bytes=tuple(int(b) for b in fit.get("block_bytes", ())),
                    stderr=tuple(float(e) for e in fit.get("stderr", ())),
                )
                for algo, fit in algos.items()
            }
            for collective, algos in data.get("corrections", {}).items()
        }
        return cls(
            intra=C.LinkCost(**data["intra"]),
            inter=C.LinkCost(**data["inter"]),
            num_hosts=int(data.get("num_hosts", 1)),
            ranks_per_host=int(data.get("ranks_per_host", 1)),
            corrections=corrections,
            tuned_blocks=bool(data.get("tuned_blocks", False)),
            pipeline_alpha_s={k: float(v) for k, v in data.get("pipeline_alpha_s", {}).items()},
            native_alpha_s=float(data.get("native_alpha_s", 0.0)),
            software_alpha_s=float(data.get("software_alpha_s", 0.0)),
            min_gain=float(data.get("min_gain", NEAR_TIE)),
            trial_choices=trial_choices,
        )

    def trial_choice(self, collective: str, nbytes: int, world_size: int) -> str | None:
        """The algorithm a trial chose for this message on this layout, if one did."""
        if world_size != self.world_size:
            return None
        return self.trial_choices.get(collective, {}).get(nbytes)

    @classmethod
    def default(
        cls, world_size: int, *, link_mbit: float | None = None, ranks_per_host: int | None = None
    ) -> Profile:
        """The uncalibrated profile of a layout (``CommConfig.link_mbit`` and
        ``ranks_per_host``, the same on every rank); ``ranks_per_host`` None, or one that does
        not divide the world, means one host."""
        local = ranks_per_host or world_size
        local = local if local >= 1 and world_size % local == 0 else world_size
        link = link_mbit
        # Loopback between processes moves about 1 GB/s with gloo (docs/design.md, "gloo").
        intra = C.LinkCost(alpha_s=60e-6, beta_s_per_byte=1.0 / 1.0e9)
        inter = C.LinkCost.from_link_gbit(link / 1000.0) if link else intra
        hosts = world_size // local
        corrections: Corrections = {}
        if link and hosts > 1 and world_size > 2:  # two ranks: all at once is one peer anyway
            corrections["all_to_all"] = {"native": UNCALIBRATED_NATIVE_ALL_TO_ALL}
        return cls(
            intra=intra,
            inter=inter,
            num_hosts=hosts,
            ranks_per_host=local,
            corrections=corrections,
            native_alpha_s=UNCALIBRATED_NATIVE_ALPHA_S,
            software_alpha_s=UNCALIBRATED_SOFTWARE_ALPHA_S,
            pipeline_alpha_s=dict.fromkeys(
                ("broadcast", "reduce", "all_reduce"), UNCALIBRATED_PIPELINE_ALPHA_S
            ),
            min_gain=UNCALIBRATED_MIN_GAIN,
        )


# -- the uncalibrated model's software costs, measured on the emulated cluster ------------------
# Balanced rounds with an A/A control, every algorithm at 4 KB-64 MB on 2, 4 and 8 hosts and
# 2 x 2 at 1 Gbit/s, 2 shared cores
# (benchmarks/auto-vs-native_netlab-2to8x1gbit-2x2x1gbit-2core.md).
# A latency-bound run (4-16 KB) costs its steps times a per-step cost, and that cost depends on
# who runs the step, not on the wire, whose alpha is a tenth of it.

#: gloo's own collectives: 0.37 ms per step with 2 ranks, 1.0-1.3 ms with 4 and 1.7-2.3 ms with
#: 8 ranks on the two cores (every rank works in every step of its ring, so they queue for the
#: cores); a middle figure.
UNCALIBRATED_NATIVE_ALPHA_S = 0.8e-3
#: commfuse's point-to-point algorithms: 1.6-3.9 ms per message (doubling, Rabenseifner, ring
#: at 2, 4 and 8 hosts): a Python isend/irecv/wait per message, gloo's pair handshake, the
#: wake-up of the rank that waits. With it the model keeps them off latency-bound sizes except
#: where they send far fewer messages (recursive doubling's lg P against the ring's 2(P - 1) on
#: 8 hosts); priced at the wire's alpha, like native, Rabenseifner looks best at 64-256 KB on 4
#: hosts and runs at 0.5-0.7x gloo there.
UNCALIBRATED_SOFTWARE_ALPHA_S = 3.0e-3
#: The pipeline's cost per block step, fitted to its broadcasts of 1-4 MB (0.74-0.81 ms; its
#: receives are posted ahead, so it pays less per message than the others), rounded up: the
#: model's hand-over to native falls at 1 MB, where the pipeline measured 0.64-1.02x gloo.
UNCALIBRATED_PIPELINE_ALPHA_S = 1.0e-3
#: Without a calibration an algorithm must be predicted this much faster than native. A
#: latency-bound time here swings by 1.3-2.5x between identical runs (the A/A control), and the
#: model's software costs are medians of such runs; the wins left are bandwidth wins (the
#: pipeline's broadcast, reduce-scatter by halving, the pairwise all-to-all), 1.3-2.8x.
UNCALIBRATED_MIN_GAIN = 0.25

#: gloo's all_to_all posts every message at once; on shaped host links those P - 1 flows share
#: each link, and from 2 MB up they reach a smaller share of it than commfuse's pairwise exchange
#: (one peer per step) does (the auto-vs-native report above). The alpha-beta model prices the
#: two alike, so without a calibration ``auto`` would keep gloo's everywhere. Until ``commfuse
#: tune`` measures the cluster at hand, this ratio (gloo's time over the model's, by size) stands
#: in for the calibration on shaped multi-host layouts of 3 or more ranks.
UNCALIBRATED_NATIVE_ALL_TO_ALL = Correction(
    sizes_bytes=(1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20),
    ratios=(1.0, 1.14, 1.19, 1.29, 1.42),
)


class TunerState:
    """What ``algo="auto"`` keeps for one communicator (``comm.owned(TunerState)``): its profile,
    loaded on first use, and the choices made with it."""

    def __init__(self, comm: Communicator) -> None:
        self.profile: Profile | None = None
        self.choices: dict[tuple[str, int], str] = {}
        """``(collective, nbytes) -> algorithm``: evaluating every model costs a fraction of a
        millisecond, a lot beside a small message."""
        self.options: dict[tuple[str, str, int], Options] = {}
        """``(collective, algorithm, nbytes) -> options`` auto runs it with (read-only: callers
        merge them into a new dict), so a repeated small message pays two lookups."""


def set_profile(comm: Communicator, profile: Profile) -> None:
    """Use ``profile`` for this communicator's ``algo="auto"`` choices (all ranks, same one)."""
    state = comm.owned(TunerState)
    state.profile = profile
    state.choices.clear()
    state.options.clear()


def profile_of(comm: Communicator) -> Profile:
    """The communicator's profile: ``set_profile``'s, else the file
    ``CommConfig.tuner_profile_path``, else the default of ``CommConfig.link_mbit`` and
    ``ranks_per_host``."""
    state = comm.owned(TunerState)
    if state.profile is None:
        config = comm.config
        if config.tuner_profile_path is not None:
            path = Path(config.tuner_profile_path)
            try:
                state.profile = Profile.from_json(path.read_text())
            except OSError as err:
                # With trials on, a missing file is where their decisions will go
                # (``save_trial_choice``): the first job creates it.
                if not (isinstance(err, FileNotFoundError) and config.tuner_trial_calls > 0):
                    raise ValueError(
                        f"CommConfig.tuner_profile_path={str(path)!r} cannot be read: "
                        f"{err.strerror}"
                    ) from err
        if state.profile is None:
            state.profile = Profile.default(
                comm.world_size, link_mbit=config.link_mbit, ranks_per_host=config.ranks_per_host
            )
    return state.profile


# -- cost of each (collective, algorithm) ---------------------------------------------------------

CostFn = Callable[[int, int, Profile], float]


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


def _lp(collective: str) -> CostFn:
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


COSTS: dict[tuple[str, str], CostFn] = {
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


def _model_at_block(
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


# -- calibration --------------------------------------------------------------------------------------


def describe(profile: Profile) -> list[dict[str, Any]]:
    """One record per calibration point: measured, model and leave-one-out errors, and whether
    ``choose`` picks that algorithm there (for ``commfuse tune``'s report)."""
    world = profile.world_size
    records: list[dict[str, Any]] = []
    for collective, algos in profile.corrections.items():
        rows: list[dict[str, Any]] = []
        for algo, fix in algos.items():
            loo = fix.leave_one_out_errors()
            for i, (size, measured) in enumerate(
                zip(fix.sizes_bytes, fix.measured_s, strict=False)
            ):
                block = fix.block_bytes[i] if i < len(fix.block_bytes) else 0
                model = _model_at_block(collective, algo, size, world, profile, block)
                rows.append(
                    {
                        "collective": collective,
                        "algo": algo,
                        "bytes": size,
                        "block_bytes": block or None,
                        "measured_s": measured,
                        "model_s": model,
                        "predicted_s": predict(collective, algo, size, world, profile),
                        "model_err": model / measured - 1.0,
                        "loo_err": loo[i],
                        "chosen": choose_for(collective, size, world, profile) == algo,
                    }
                )
        rows.sort(key=lambda r: (r["bytes"], r["measured_s"]))
        best: dict[Any, Any] = {}
        for row in rows:  # fastest first within each size
            best.setdefault(row["bytes"], row["measured_s"])
        for row in rows:
            # Measured over the best measured at its size, less 1: the chosen row's is auto's.
            row["regret"] = row["measured_s"] / best[row["bytes"]] - 1.0
        records.extend(rows)
    return records


def pick_summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per collective, from ``describe``'s records: how often ``choose`` picks each algorithm
    over the calibration sizes, how often that is the fastest measured, and its regret (the
    pick's measured time over the fastest's, less 1), median and worst."""
    picked: dict[str, list[dict[str, Any]]] = {}
    for row in records:
        if row["chosen"]:
            picked.setdefault(row["collective"], []).append(row)
    return [
        {
            "collective": collective,
            **pick_stats(
                [row["algo"] for row in rows],
                [row["regret"] for row in rows],
                best_picked=sum(row["regret"] == 0.0 for row in rows),
            ),
        }
        for collective, rows in picked.items()
    ]


def pick_stats(
    picks: Sequence[str], regrets: Sequence[float], *, best_picked: int
) -> dict[str, Any]:
    """One summary of a choice made at several sizes: how many sizes, how often each algorithm
    was picked (most often first), how often the pick was the fastest measured, and the regret
    (pick's time over the fastest's, less 1), median and worst."""
    counts = collections.Counter(picks)
    return {
        "sizes": len(picks),
        "picks": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "best_picked": best_picked,
        "median_regret": statistics.median(regrets),
        "max_regret": max(regrets),
    }

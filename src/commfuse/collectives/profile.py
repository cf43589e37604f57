"""The tuner's profile of a cluster: link costs and, per algorithm, how the cost models of
``cost.py`` must be corrected to match what was measured (``tuner.py`` chooses with it).

Calibration (``calibration.py``) runs on every rank of the cluster it describes:

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

Design notes: ``docs/collectives.md``, "The tuner: why measure every algorithm, and the defaults".
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from commfuse.collectives import cost as C
from commfuse.collectives.registry import COLLECTIVES, Options

if TYPE_CHECKING:
    # Annotations only: the profile is arithmetic, which the simulator uses without torch.
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
        """The profile as ``commfuse tune`` saves it, named as a ``tune`` record (the kind
        ``commfuse report`` renders it by: ``commfuse.bench.records.TuneProfileRecord``)."""
        return json.dumps({"kind": "tune", **dataclasses.asdict(self)}, indent=1)

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
            native_alpha_s=_UNCALIBRATED_NATIVE_ALPHA_S,
            software_alpha_s=_UNCALIBRATED_SOFTWARE_ALPHA_S,
            pipeline_alpha_s=dict.fromkeys(
                ("broadcast", "reduce", "all_reduce"), _UNCALIBRATED_PIPELINE_ALPHA_S
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
_UNCALIBRATED_NATIVE_ALPHA_S = 0.8e-3
#: commfuse's point-to-point algorithms: 1.6-3.9 ms per message (doubling, Rabenseifner, ring
#: at 2, 4 and 8 hosts): a Python isend/irecv/wait per message, gloo's pair handshake, the
#: wake-up of the rank that waits. With it the model keeps them off latency-bound sizes except
#: where they send far fewer messages (recursive doubling's lg P against the ring's 2(P - 1) on
#: 8 hosts); priced at the wire's alpha, like native, Rabenseifner looks best at 64-256 KB on 4
#: hosts and runs at 0.5-0.7x gloo there.
_UNCALIBRATED_SOFTWARE_ALPHA_S = 3.0e-3
#: The pipeline's cost per block step, fitted to its broadcasts of 1-4 MB (0.74-0.81 ms; its
#: receives are posted ahead, so it pays less per message than the others), rounded up: the
#: model's hand-over to native falls at 1 MB, where the pipeline measured 0.64-1.02x gloo.
_UNCALIBRATED_PIPELINE_ALPHA_S = 1.0e-3
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

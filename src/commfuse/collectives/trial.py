"""Timed trials at first use: ``algo="auto"`` measures its best candidates on the caller's own
messages before it settles, where a model alone cannot tell them apart.

With ``CommConfig.tuner_trial_calls = k`` (0, the default, turns trials off), the first calls of
each (collective, size) under ``algo="auto"`` run:

1. the **candidates**: native and the two other algorithms the model ranks fastest (those with
   a finite prediction), so a trial costs at most three algorithms' worth of calls;
2. one **untimed call of each** (a point-to-point algorithm's first call connects its pairs);
3. ``k`` **timed rounds**, every candidate once per round, the order rotated each round so no
   candidate always runs first (a round's first call pays for whatever ran before);
4. the **decision**, at the end of the last timed call: each rank's median per candidate, made
   the same on every rank by a max over ranks (a collective lasts as long as its slowest
   rank), then native unless another candidate's median is ``TRIAL_MIN_GAIN`` faster. Every
   rank reads the same reduced medians, so every rank decides the same.

Every call of the trial is a real call: it runs one of the candidates on the caller's buffers
and returns its correct result. The decision then stands in the tuner's cache for the
communicator's life, as the model's choice would (``tuner.choose``), and ``outcomes`` keeps the
medians for reports. With ``CommConfig.tuner_profile_path`` set, the decision is also written to
that profile (``Profile.trial_choices``; the file is created when missing), and a later job on
the same layout takes it from there without a trial, as MPI libraries keep their tuned
decisions in a file that later runs read. All calls of a trial must be made in the same order
on every rank, as every collective must.

Design notes: ``docs/collectives.md``, "Timed trials: why a model is not enough".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from commfuse.collectives import tuner
from commfuse.collectives.profile import profile_of

if TYPE_CHECKING:
    from commfuse.comm import Communicator

#: Algorithms beside native a trial times: the model's fastest others.
_TRIAL_OTHERS = 2
#: How much faster than native a candidate's median must be to be chosen: 0.2 means 20%. Medians
#: of a few latency-bound calls on shared cores are noisy (an A/A ratio of 0.85-1.15 is usual for
#: small messages), and native is the safe default.
TRIAL_MIN_GAIN = 0.2

#: Records a call's seconds.
_Recorder = Callable[[float], None]


@dataclasses.dataclass(frozen=True)
class _TrialOutcome:
    """What one trial measured and decided."""

    collective: str
    nbytes: int
    candidates: tuple[str, ...]
    median_s: tuple[float, ...]
    """Per candidate, the median of the timed calls, slowest rank's (max over ranks)."""
    chosen: str


class _Trial:
    """The calls of one (collective, size) until its decision."""

    def __init__(self, candidates: tuple[str, ...], rounds: int) -> None:
        self.candidates = candidates
        self.rounds = rounds
        self.calls = 0
        self.samples: list[list[float]] = [[] for _ in candidates]

    @property
    def total_calls(self) -> int:
        return len(self.candidates) * (1 + self.rounds)

    def next_candidate(self) -> tuple[int, bool]:
        """(index of the candidate the next call runs, whether that call is timed)."""
        count = len(self.candidates)
        j = self.calls
        if j < count:
            return j, False
        timed = j - count
        round_, position = divmod(timed, count)
        return (position + round_) % count, True


class _TrialState:
    """The trials of one communicator (``comm.owned(_TrialState)``): running and finished."""

    def __init__(self, comm: Communicator) -> None:
        self.running: dict[tuple[str, int], _Trial] = {}
        self.outcomes: dict[tuple[str, int], _TrialOutcome] = {}
        self.from_profile: set[tuple[str, int]] = set()
        """Messages whose decision the profile held: ``algo="auto"`` runs it, no trial."""


def pick_candidates(ranked: Sequence[tuple[float, str]]) -> tuple[str, ...]:
    """Native and the ``_TRIAL_OTHERS`` fastest others of a model's ranking (seconds, name),
    leaving out those the model cannot price (an algorithm that does not fit the layout)."""
    others = [name for seconds, name in ranked if name != "native" and math.isfinite(seconds)]
    return ("native", *others[:_TRIAL_OTHERS])


def decide(candidates: Sequence[str], median_s: Sequence[float]) -> str:
    """Native, unless the fastest other candidate's median is ``TRIAL_MIN_GAIN`` below native's
    (ties between others go to the earlier, the model's favourite)."""
    times = dict(zip(candidates, median_s, strict=True))
    best = min(
        (name for name in candidates if name != "native"), key=times.__getitem__, default=None
    )
    if best is None or times[best] * (1.0 + TRIAL_MIN_GAIN) >= times["native"]:
        return "native"
    return best


def exploring(comm: Communicator, collective: str, nbytes: int) -> bool:
    """Whether ``algo="auto"`` would still be trying candidates for this message (trials on and
    not yet decided, here or by an earlier job in the profile): a benchmark calls until this is
    false before it starts timing."""
    if comm.config.tuner_trial_calls <= 0:
        return False
    return not _settled(comm, comm.owned(_TrialState), (collective, nbytes))


def _settled(comm: Communicator, state: _TrialState, key: tuple[str, int]) -> bool:
    """Whether this message needs no trial: decided by this communicator's own, or found in the
    profile (an earlier job's trial on the same layout)."""
    if key in state.outcomes or key in state.from_profile:
        return True
    if key in state.running:
        return False
    if profile_of(comm).trial_choice(*key, comm.world_size) is None:
        return False
    state.from_profile.add(key)
    return True


def next_call(
    comm: Communicator, collective: str, nbytes: int, like: torch.Tensor
) -> tuple[str, _Recorder | None] | None:
    """The algorithm the next ``algo="auto"`` call of this message runs during its trial, with a
    recorder for its time when the call is timed; None when trials are off or decided (the
    tuner's choice then stands). ``like``: a tensor on the caller's device, where the decision's
    medians are reduced."""
    rounds = comm.config.tuner_trial_calls
    if rounds <= 0:  # checked first: every auto call passes here
        return None
    key = (collective, nbytes)
    state = comm.owned(_TrialState)
    if _settled(comm, state, key):
        return None
    trial = state.running.get(key)
    if trial is None:
        profile = profile_of(comm)
        ranked = tuner.rank_algorithms(collective, nbytes, comm.world_size, profile)
        trial = state.running[key] = _Trial(pick_candidates(ranked), rounds)
    index, timed = trial.next_candidate()
    trial.calls += 1
    name = trial.candidates[index]
    last = trial.calls == trial.total_calls

    def record(seconds: float) -> None:
        if timed:
            trial.samples[index].append(seconds)
        if last:
            _finish(comm, key, trial, like)

    return name, (record if timed or last else None)


def _finish(comm: Communicator, key: tuple[str, int], trial: _Trial, like: torch.Tensor) -> None:
    """Reduce the medians over ranks, decide, and hand the decision to the tuner's cache."""
    medians = like.new_tensor(
        [statistics.median(samples) for samples in trial.samples], dtype=torch.float64
    )
    comm.all_reduce(medians, "max")
    median_s = tuple(float(m) for m in medians.tolist())
    chosen = decide(trial.candidates, median_s)
    collective, nbytes = key
    state = comm.owned(_TrialState)
    state.outcomes[key] = _TrialOutcome(collective, nbytes, trial.candidates, median_s, chosen)
    del state.running[key]
    tuner.remember_choice(comm, collective, nbytes, chosen)
    tuner.save_trial_choice(comm, collective, nbytes, chosen)


def outcomes(comm: Communicator) -> list[_TrialOutcome]:
    """The trials this communicator has decided, in the order they were decided."""
    return list(comm.owned(_TrialState).outcomes.values())

"""``commfuse compare --fault-tolerant``: what torchft costs, without faults and under them.

Each strategy runs as a pair of jobs, in the balanced rounds of ``bench/schedule.py`` (every
round permutes all the jobs of all the pairs, so no job always runs first or after the same
neighbour):

* without faults (no ``--chaos``): the strategy's plain run (``run_training``: torch DDP, or
  commfuse's engine with its compressor, no torchft) and its fault-tolerant run: the ratio is
  the **overhead** of fault tolerance (the quorum RPC and the commit vote of every step, the
  hook's exchange on its worker thread, the compressor state kept to undo a failed step);
* with faults: its fault-tolerant run without faults and with them: the ratio is the
  **goodput** kept under faults, and the held-out losses compare the models the two deliver
  after the same number of committed steps.

The figure timed is the time per committed step after the warm-up: a plain run's mean step
time, a fault-tolerant run's inverse goodput (``goodput.py``: failed attempts, waits for a
quorum and recoveries fall inside it). A pair's ratio is the median over rounds of the
per-round ratio, with its distribution-free 95% interval; ``control`` runs the first
strategy's reference twice per round (an A/A pair), and a pair whose interval holds 1, or
whose ratio lies within the control's, is a tie.

Records (one per job, the reference first): ``s_per_step`` (median over rounds, and each
round's), ``time_ratio`` (this job's time over its reference's; 1 for a reference) and
``goodput_ratio`` (its inverse, per round, then the median), the faults that landed during
training (``events``; ``events_idle`` those that hit a replica after the last commit or
before it rejoined) with their detection and recovery times (median and max over all
rounds), steps committed and discarded, samples lost, whether the replicas agreed, and the
held-out loss.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Literal

from commfuse.bench.schedule import Schedule, control_name, median_interval, run_rounds, summarize
from commfuse.cluster import Topology
from commfuse.ft.config import FaultToleranceConfig
from commfuse.train.loop import TrainConfig
from commfuse.train.strategy import StrategyConfig, describe_strategy

#: Steps left out at the start of every run's timing (as ``train/runner.py``).
_WARMUP_STEPS = 2
#: Keys of a fault-tolerant run's record kept per round (the per-attempt list is dropped).
_KEPT = (
    "committed_steps",
    "discarded_steps",
    "samples_lost",
    "samples_duplicated",
    "step_digests_agree",
    "replicas_agree",
    "events",
    "restarts",
    "goodput_steps_per_s",
    "goodput_window_s",
    "step_time_s",
    "eval_loss",
    "eval_accuracy",
    "final_loss",
    "wall_s",
    "global_batch",
    "losses",
)


@dataclasses.dataclass(frozen=True)
class _Job:
    strategy: int
    mode: Literal["plain", "ft", "chaos"]
    """plain (no torchft), ft (torchft, no faults) or chaos (torchft with the faults)."""
    name: str
    ref: int
    """The index of the job this one's ratio is to (its own for a reference)."""


def _jobs(labels: Sequence[str], faulty: bool, control: bool) -> list[_Job]:
    jobs: list[_Job] = []
    for i, label in enumerate(labels):
        ref = len(jobs)
        if faulty:
            jobs += [
                _Job(i, "ft", f"{label} (ft)", ref),
                _Job(i, "chaos", f"{label} (ft, faults)", ref),
            ]
        else:
            jobs += [_Job(i, "plain", label, ref), _Job(i, "ft", f"{label} (ft)", ref)]
    if control:
        jobs.append(dataclasses.replace(jobs[0], name=control_name(jobs[0].name)))
    return jobs


def compare_fault_tolerance(
    strategies: Sequence[StrategyConfig],
    base: TrainConfig,
    topology: Topology,
    ft: FaultToleranceConfig,
    *,
    repeats: int = 1,
    control: bool = False,
    emulate: bool | None = None,
    timeout_s: float = 3600.0,
    labels: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Every strategy's pair of jobs (see the module docstring), in ``repeats`` balanced
    rounds; returns one record per job.

    Args:
        strategies: what ``run_fault_tolerant`` accepts (``ddp``, a compressor's name, a
            per-period method such as ``diloco(H=50)``).
        base: workload, steps, seed and bucket size of every run.
        topology: one replica group per host.
        ft: the timeout, the quorum's minimum, the global batch policy and the faults (none:
            the pairs measure the overhead; some: the goodput under them).
        repeats: rounds; control: run the first reference twice per round (A/A).
        emulate: the emulated network (None: when possible); timeout_s: each job's deadline.
        labels: the strategies' names in the records (default: ``describe_strategy``).

    Raises:
        ValueError: no strategy, a strategy given twice, repeats < 1, or one that
            fault-tolerant training refuses.
    """
    from commfuse.ft.launch import run_fault_tolerant
    from commfuse.ft.periods import ft_mode
    from commfuse.train.runner import run_training

    if not strategies:
        raise ValueError("strategies must name at least one strategy")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for strategy in strategies:
        ft_mode(strategy)  # ValueError before anything starts
    ft.check_hosts(topology.num_hosts, topology.ranks_per_host)
    labels = list(labels) or [describe_strategy(s) for s in strategies]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a strategy is given twice: {', '.join(labels)}")
    jobs = _jobs(labels, bool(ft.faults), control)
    fault_free = dataclasses.replace(ft, faults=())
    # seed=None: round 1 in the given order, round 2 reversed, ... (bench/schedule.py)
    schedule = Schedule(
        tuple(job.name for job in (jobs[:-1] if control else jobs)),  # the A/A copy: control
        rounds=repeats,
        control=control,
        seed=None,
    )
    names = list(schedule.names)

    def run(name: str, round_: int) -> dict[str, Any]:
        j = names.index(name)
        job = jobs[j]
        config = dataclasses.replace(
            base, strategy=strategies[job.strategy], label=job.name, compute_steps=0
        )
        log(f"[{j + 1}/{len(jobs)}] {job.name} (round {round_ + 1}/{repeats})")
        if job.mode == "plain":
            r = run_training(config, topology, emulate=emulate, progress=False,
                             timeout_s=timeout_s, warmup=_WARMUP_STEPS)  # fmt: skip
            result = _plain(r)
        else:
            r = run_fault_tolerant(
                config,
                ft if job.mode == "chaos" else fault_free,
                topology,
                emulate=emulate,
                timeout_s=timeout_s,
            )
            result = {k: r.get(k) for k in _KEPT} | _ft_time(r)
        log("  " + _one_line(result))
        return result

    by_name = run_rounds(schedule, run)
    runs = {j: by_name[name] for j, name in enumerate(names)}
    return _records(jobs, runs, control)


def _plain(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "s_per_step": r["mean_step_time_s"],
        "step_time_s": r["step_time_s"],
        "final_loss": r["final_loss"],
        "eval_loss": r["eval_loss"],
        "eval_accuracy": r["eval_accuracy"],
        "wall_s": r["wall_s"],
        "replicas_agree": r["ranks_agree"],
        "digest": r["digest"],
    }


def _ft_time(r: dict[str, Any]) -> dict[str, Any]:
    """The time per committed step, and where a committed step's time goes (medians over
    the committed attempts after the warm-up): the wait for the quorum (``quorum_s``; in
    per-step mode the forward runs while the quorum is asked for, and only the wait left
    after it counts), forward and backward with the hook's exchange (``backward_s``), and
    the commit vote with the optimizer step and the report (``commit_s``), of which the vote
    alone (``vote_s``)."""
    good = r.get("goodput_steps_per_s")
    # The warm-up counts from the run's first step (a checkpoint's, with init_from).
    warm = r.get("first_step", 0) + _WARMUP_STEPS
    steady = [
        a
        for a in r["records"]
        if a["committed"] and a["step"] >= warm and "t_backward" in a  # per-step mode
    ]

    def median(of: Callable[[dict[str, Any]], float]) -> float | None:
        return statistics.median(of(a) for a in steady) if steady else None

    def quorum(a: dict[str, Any]) -> float:
        return float(a["t_quorum"] - a.get("t_forward", a["t0"]))

    def compute(a: dict[str, Any]) -> float:
        forward = a["t_forward"] - a["t0"] if "t_forward" in a else 0.0
        return float(forward + a["t_backward"] - a["t_quorum"])

    return {
        "s_per_step": None if not good else 1.0 / good,
        "digest": r.get("digest"),
        "quorum_s": median(quorum),
        "backward_s": median(compute),
        "commit_s": median(lambda a: float(a["t"] - a["t_backward"])),
        "vote_s": median(lambda a: float(a.get("t_voted", a["t"]) - a["t_backward"])),
    }


def _one_line(r: dict[str, Any]) -> str:
    held = "-" if r.get("eval_loss") is None else f"{r['eval_loss']:.4f}"
    events = f", {len(r['events'])} faults" if r.get("events") else ""
    return f"{r['s_per_step'] * 1e3:.0f} ms per committed step, held-out loss {held}{events}"


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _records(
    jobs: list[_Job], runs: dict[int, list[dict[str, Any]]], control: bool
) -> list[dict[str, Any]]:
    times = {j: [r["s_per_step"] for r in runs[j]] for j in runs}
    floor = None
    if control:
        floor = summarize(
            {"base": times[0], "control": times[len(jobs) - 1]}, baseline="base", control="control"
        )
    records = []
    for j, job in enumerate(jobs):
        ref = job.ref  # the A/A copy's is the first reference
        per_round = [t / b for t, b in zip(times[j], times[ref], strict=True)]
        rounds = runs[j]
        held = [r.get("eval_loss") for r in rounds]
        held_ref = [r.get("eval_loss") for r in runs[ref]]
        # Faults during training: a kill after the last commit (the replica was evaluating or
        # shutting down) or of a replica still joining cost nobody a step.
        events = [
            e
            for r in rounds
            for e in r.get("events") or []
            if e.get("step") is not None and e.get("in_quorum", True)
        ]
        record: dict[str, Any] = {
            "strategy": job.name,
            "mode": job.mode,
            "reference": jobs[ref].name,
            "repeats": len(rounds),
            "s_per_step": statistics.median(times[j]),
            "s_per_step_rounds": times[j],
            "time_ratio": statistics.median(per_round),
            "time_ratio_rounds": per_round,
            "goodput_ratio": statistics.median(1.0 / x for x in per_round),
            "ratio_ci": median_interval(per_round) if ref != j else None,
            "held_loss": _median(held),
            "held_loss_ratio": _median(
                [
                    h / b if h is not None and b else None
                    for h, b in zip(held, held_ref, strict=True)
                ]
            ),
            "held_loss_ratio_max": max(
                (h / b for h, b in zip(held, held_ref, strict=True) if h is not None and b),
                default=None,
            ),
            "events": len(events),
            "events_idle": sum(len(r.get("events") or []) for r in rounds) - len(events),
            "detect_s": _spread([e["detect_s"] for e in events]),
            "recover_s": _spread([e["recover_s"] for e in events]),
            "rejoin_s": _spread([e["rejoin_s"] for e in events]),
            "rounds": rounds,
        }
        for key in ("quorum_s", "backward_s", "commit_s", "vote_s"):
            record[key] = _median([r.get(key) for r in rounds])
        for key in ("committed_steps", "discarded_steps", "samples_lost", "samples_duplicated"):
            values = [r[key] for r in rounds if r.get(key) is not None]
            record[key] = sum(values) if values else None
        record["replicas_agree"] = all(r.get("replicas_agree") for r in rounds)
        if floor is not None:
            record.update(floor.as_dict())
            if ref != j:
                low, high = record["ratio_ci"]
                record["tie"] = low <= 1.0 <= high or bool(floor.is_tie(record["time_ratio"]))
            else:
                record["tie"] = None
        record["kind"] = "compare --fault-tolerant"  # commfuse report's table
        records.append(record)
    return records


def merge_rounds(files: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The records of several runs of one ``compare --fault-tolerant`` command (rounds that
    did not fit one job) as one result: each job's rounds from every file, its medians,
    ratios and fault times over all of them, as if one job had run every round.

    Raises:
        ValueError: files whose jobs differ (names, modes, references, the control).
    """
    if not files:
        return []
    shape = [(r["strategy"], r["mode"], r["reference"]) for r in files[0]]
    for records in files[1:]:
        other = [(r["strategy"], r["mode"], r["reference"]) for r in records]
        if other != shape:
            raise ValueError(f"these runs ran different jobs: {shape} and {other}")
    names = [name for name, _, _ in shape]
    jobs = [
        _Job(i, mode, name, names.index(reference))
        for i, (name, mode, reference) in enumerate(shape)
    ]
    control = len(jobs) > 1 and names[-1] == control_name(names[0])
    runs = {j: [run for records in files for run in records[j]["rounds"]] for j in range(len(jobs))}
    return _records(jobs, runs, control)


def _spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Median and max of the known values, and how many were unknown (a fault that no step
    noticed, or a replica that never rejoined)."""
    known = [v for v in values if v is not None]
    return {
        "median": statistics.median(known) if known else None,
        "max": max(known) if known else None,
        "unknown": len(values) - len(known),
    }


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _med_max(key: str) -> Callable[[dict[str, Any]], str]:
    def cell(r: dict[str, Any]) -> str:
        spread = r[key]
        if spread["median"] is None:
            return "-"
        return f"{spread['median']:.2f}/{spread['max']:.2f}"

    return cell


def _ratio(key: str) -> Callable[[dict[str, Any]], str]:
    def cell(r: dict[str, Any]) -> str:
        if r["reference"] == r["strategy"]:
            return "1.000"
        return format(r[key], ".3f") + (" (tie)" if r.get("tie") else "")

    return cell


def _interval(r: dict[str, Any]) -> str:
    return "-" if r.get("ratio_ci") is None else "{:.2f}-{:.2f}".format(*r["ratio_ci"])


def columns(records: Sequence[dict[str, Any]]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The table's columns; the interval's is named ``95%`` from six rounds, ``range`` below
    (``bench.table.interval_label``)."""
    from commfuse.bench.table import interval_label

    return [
        ("run", lambda r: r["strategy"]),
        ("ms/step", lambda r: _fmt(r["s_per_step"], ".0f", 1e3)),
        ("time/ref", _ratio("time_ratio")),
        (interval_label(records), _interval),
        ("goodput/ref", _ratio("goodput_ratio")),
        ("committed", lambda r: str(r["committed_steps"] or "-")),
        ("discarded", lambda r: str(r["discarded_steps"] if r["mode"] != "plain" else "-")),
        ("lost", lambda r: str(r["samples_lost"] if r["mode"] != "plain" else "-")),
        ("faults", lambda r: str(r["events"])),
        ("detect_s", _med_max("detect_s")),
        ("recover_s", _med_max("recover_s")),
        ("rejoin_s", _med_max("rejoin_s")),
        ("agree", lambda r: "yes" if r["replicas_agree"] else "NO"),
        ("held_loss", lambda r: _fmt(r["held_loss"], ".4f")),
        ("held/ref", lambda r: _fmt(r["held_loss_ratio"], ".4f")),
    ]


def render_table(records: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The records as ``commfuse compare --fault-tolerant`` prints them."""
    from commfuse.bench.table import render

    return render(records, columns(records), markdown=markdown)


LEGEND = """\
ms/step      time per committed step after the warm-up, median over rounds: a plain run's mean
             step, a fault-tolerant run's inverse goodput (failed steps, quorum waits and
             recoveries included)
time/ref     this run's time per committed step over its reference's (the row above it),
             median of the per-round ratios; 95% = that median's interval over rounds,
             headed "range" below six rounds (the rounds' whole range, short of 95%);
             goodput/ref = the median of the inverse ratios
committed    steps committed, summed over rounds; discarded = failed attempts (over replicas);
             lost = samples of committed steps that no replica trained
detect_s     seconds from a fault to the survivors' first failed step or smaller quorum;
             recover_s = to their first commit of a step begun after it; rejoin_s = to the
             killed replica's first commit after its restart (median/max over all faults)
agree        every replica's final parameters equal (every round)
held_loss    the final model's held-out loss (median over rounds); held/ref = over the
             reference's of the same round (median)"""

"""``commfuse compare``: several strategies, same workload, seeds and cluster; one table, one plot.

Strategies run one after another, each in a job of its own. ``--repeats R`` runs R rounds in
the balanced orders of ``bench/schedule.py`` (A B C D, D C B A, ...: every strategy's mean
position is the middle one after every two rounds), and reports the median over rounds of the
step time (median and mean), the compute-only step time, the busy share and the time to the
baseline's loss, with each round's value beside it; the losses, bytes and accuracy come from the
first round (the rounds train the same model on the same batches). With ``control`` the
baseline runs twice per round, as a second strategy (``ddp'``): its speedup is the noise floor of
the job, and a ratio within it is a tie. The baseline is ``ddp`` (torch's DDP) when it is among
them, else the first strategy. The columns are defined in ``docs/benchmarking.md``, "The
columns of commfuse compare".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commfuse.bench.schedule import Schedule, run_rounds, summarize
from commfuse.bench.table import ratio_cell, render
from commfuse.cluster import Topology
from commfuse.train.loop import TrainConfig
from commfuse.train.metrics import time_to_loss_s
from commfuse.train.runner import run_training
from commfuse.train.strategy import StrategyConfig, describe_strategy, is_baseline

#: The specs ``commfuse compare`` runs with no arguments (about 4 minutes on 2 cores, as root).
DEFAULT_STRATEGIES = (
    "ddp",
    # torch's PowerSGD hook at its strongest: rank 8, the fewest warm-up steps torch allows
    # (2), in its fp16_compress_wrapper (warm-up and factors in 16 bits: rank 4's bytes, rank
    # 8's loss). Its bf16 wrapper would do the same, but torch refuses it in a CPU build.
    "ddp-powersgd:rank=8,warmup=2,wire=fp16",
    "commfuse",
    # Like for like with the hook above: the same rank, warm-up steps, 16-bit warm-up and
    # factors (the headline ratio to torch).
    "powersgd:rank=8,warmup=2,warmup_fp16=1,wire=fp16",
    # The warm-up as rank-32 PowerSGD (2.3 MB instead of 6.45 in fp16), which torch's hook
    # cannot do, and bf16 factors.
    "powersgd:rank=8,warmup=2,warmup_rank=32,wire=bf16",
)
_DEFAULT_WORKLOAD = "charlm"
DEFAULT_STEPS = 20
DEFAULT_HOSTS = 4
DEFAULT_LINK = "100mbit"
#: Compute-only steps timed after each run (their median is ``compute_step_time_s``).
DEFAULT_COMPUTE_STEPS = 4


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare_strategies(
    strategies: Sequence[StrategyConfig],
    base: TrainConfig,
    topology: Topology,
    *,
    repeats: int = 1,
    control: bool = False,
    max_steps_factor: float = 1.0,
    emulate: bool | None = None,
    progress: bool | None = None,
    timeout_s: float | None = 3600.0,
    log: Callable[[str], None] = print,
    labels: Sequence[str] = (),
    backend: str = "gloo",
) -> list[dict[str, Any]]:
    """Run every strategy with ``base``'s other settings (workload, seed, steps, schedule,
    starting checkpoint); return one record per strategy.
    ``labels`` name them in the records (default: ``describe_strategy``); ``backend`` is every
    job's process group's (``run_training``: nccl puts each rank on its GPU).

    ``max_steps_factor`` > 1: every strategy but the baseline trains on up to that multiple of
    ``base.steps`` (``TrainConfig.extra_steps``), so that one that learns less per step (a
    compressor, local SGD) still shows when it reaches the baseline's final loss; its other
    figures are read at ``base.steps``, like the baseline's. ``control`` also runs the baseline
    a second time in every round (its record is named ``control_name(label)``, last)."""
    if not strategies:
        raise ValueError("strategies must name at least one strategy")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if max_steps_factor < 1:
        raise ValueError(f"max_steps_factor must be at least 1, got {max_steps_factor}")
    if labels and len(labels) != len(strategies):
        raise ValueError(f"{len(labels)} labels for {len(strategies)} strategies")
    canonical = [describe_strategy(s) for s in strategies]
    labels = list(labels) or canonical
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"a strategy is given twice: {', '.join(canonical)}")
    baseline = next((i for i, s in enumerate(strategies) if is_baseline(s)), 0)
    done_steps = _checkpoint_step(base.init_from) if base.init_from else 0
    extra = round((max_steps_factor - 1) * (base.steps - done_steps))
    # Jobs: every strategy, and with a control the baseline once more (a run of its own).
    # seed=None: round 1 in the given order, round 2 reversed, ... (bench/schedule.py)
    schedule = Schedule(
        tuple(labels), rounds=repeats, baseline=labels[baseline], control=control, seed=None
    )
    job_names = list(schedule.names)
    jobs = list(range(len(strategies))) + ([baseline] if control else [])

    def run(name: str, round_: int) -> dict[str, Any]:
        j = job_names.index(name)
        i = jobs[j]
        # Every other setting (workload, steps, seed, schedule, ...) is the base's.
        config = dataclasses.replace(
            base,
            strategy=strategies[i],
            label=name,
            extra_steps=0 if i == baseline else extra,
        )
        suffix = f" (round {round_ + 1}/{repeats})" if repeats > 1 else ""
        log(f"[{j + 1}/{len(jobs)}] {name}{suffix}")
        return run_training(
            config,
            topology,
            emulate=emulate,
            progress=progress,
            timeout_s=timeout_s,
            backend=backend,
        )

    by_name = run_rounds(schedule, run)
    runs = {j: by_name[name] for j, name in enumerate(job_names)}
    records = []
    for j in range(len(jobs)):
        record = dict(runs[j][0])
        record["repeats"] = repeats
        record["step_time_s_rounds"] = [r["step_time_s"] for r in runs[j]]
        record["mean_step_time_s_rounds"] = [r["mean_step_time_s"] for r in runs[j]]
        record["step_time_s"] = statistics.median(record["step_time_s_rounds"])
        record["mean_step_time_s"] = statistics.median(record["mean_step_time_s_rounds"])
        for key in (
            "compute_step_time_s",
            "worst_phase_step_s",
            "cpu_floor_s",
            "machine_busy",
            "mean_exchange_wait_s",
            "exchange_cpu_s",
            "compute_machine_busy",
            "machine_bound_s",
        ):
            known = [r[key] for r in runs[j] if r.get(key) is not None]  # rounds that measured it
            if known:  # else round 1's: None
                record[key] = statistics.median(known)
        # Each round's own curves: its loss may differ in the last bits (reduction order).
        record["curves_rounds"] = [(r["loss_curve"], r["wall_curve_s"]) for r in runs[j]]
        if j >= len(strategies):  # the control: the baseline's second run
            record["strategy"] = job_names[j]
            record["control_of"] = labels[baseline]
        record["kind"] = "compare"  # commfuse report's table (cli/report.py, KINDS)
        records.append(record)
    add_comparisons(records)
    if control:
        # The noise floor: the baseline's two runs, by the figure speedup is made of.
        summary = summarize(
            {
                "base": records[baseline]["mean_step_time_s_rounds"],
                "control": records[-1]["mean_step_time_s_rounds"],
            },
            baseline="base",
            control="control",
            paired=False,
        )
        for r in records:
            r.update(summary.as_dict())
            speedup = r.get("speedup_vs_ddp")
            r["tie"] = (
                None if r is records[baseline] or speedup is None else summary.is_tie(speedup)
            )
    return records


def _checkpoint_step(root: str) -> int:
    from commfuse.train.checkpoint import latest_step

    return latest_step(root) or 0


def add_comparisons(records: list[dict[str, Any]]) -> None:
    """Fill the baseline-relative fields (in place)."""
    ddp = next(
        (r for r in records if r.get("strategy_name") == "ddp" and "control_of" not in r), None
    )
    baseline = ddp or records[0]
    target = baseline["final_loss"]
    for r in records:
        r["baseline"] = baseline["strategy"]
        rounds = r.pop("curves_rounds", None)
        if not rounds:
            r["time_to_baseline_loss_s"] = time_to_loss_s(r, target)
            continue
        times = [
            time_to_loss_s({"loss_curve": loss, "wall_curve_s": wall}, target)
            for loss, wall in rounds
        ]
        r["time_to_baseline_loss_s_rounds"] = times
        # A round that never got there counts as slower than any that did.
        middle = statistics.median([math.inf if t is None else t for t in times])
        r["time_to_baseline_loss_s"] = None if math.isinf(middle) else middle
    for r in records:
        r["step_over_compute"] = _ratio(r["step_time_s"], r["compute_step_time_s"])
        r["worst_phase_over_compute"] = _ratio(
            r.get("worst_phase_step_s"), r["compute_step_time_s"]
        )
        r["worst_phase_over_bound"] = _ratio(r.get("worst_phase_step_s"), r.get("machine_bound_s"))
        r["bytes_reduction_vs_baseline"] = _ratio(baseline["bytes_per_step"], r["bytes_per_step"])
        # Means, not medians: a DiLoCo step that synchronises is rare but real time.
        r["speedup_vs_ddp"] = (
            None if ddp is None else _ratio(ddp["mean_step_time_s"], r["mean_step_time_s"])
        )
        r["time_to_loss_speedup_vs_ddp"] = (
            None
            if ddp is None
            else _ratio(ddp["time_to_baseline_loss_s"], r["time_to_baseline_loss_s"])
        )


#: A run whose steps kept at least this share of the machine's cores busy is called CPU-bound.
_CPU_BOUND_BUSY = 0.9


def cpu_bound_note(records: Sequence[dict[str, Any]]) -> str | None:
    """One line naming the strategies whose steps kept the cores >= ``_CPU_BOUND_BUSY`` busy:
    there the cores, not the network, set the step, so sending fewer bytes cannot make it
    shorter and spending less CPU can (on the emulated cluster the kernel's packet work and
    every rank share one machine's cores). None when no run was."""
    bound = [
        f"{r['strategy']} ({r['machine_busy']:.0%})"
        for r in records
        if (r.get("machine_busy") or 0.0) >= _CPU_BOUND_BUSY
    ]
    if not bound:
        return None
    return (
        "CPU-bound here (the cores, not the network, set the step; fewer bytes will not shorten "
        f"it): {', '.join(bound)}"
    )


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


_COMPARE_COLUMNS = (
    ("strategy", lambda r: r["strategy"]),
    ("step_ms", lambda r: _fmt(r["step_time_s"], ".0f", 1e3)),
    ("compute_ms", lambda r: _fmt(r["compute_step_time_s"], ".0f", 1e3)),
    ("step/compute", lambda r: _fmt(r["step_over_compute"], ".2f")),
    ("worst/compute", lambda r: _fmt(r.get("worst_phase_over_compute"), ".2f")),
    ("busy", lambda r: _fmt(r.get("machine_busy"), ".0%")),
    ("MB/step", lambda r: _fmt(r["bytes_per_step"], ".3f", 1e-6)),
    ("x less", lambda r: _fmt(r["bytes_reduction_vs_baseline"], ".1f")),
    ("peak_MB", lambda r: _fmt(r["peak_bytes_per_step"], ".2f", 1e-6)),
    ("final_loss", lambda r: _fmt(r["final_loss"], ".3f")),
    ("held_loss", lambda r: _fmt(r["eval_loss"], ".3f")),
    ("acc", lambda r: _fmt(r["eval_accuracy"], ".1f", 100.0)),
    ("wall_s", lambda r: _fmt(r["wall_s"], ".1f")),
    ("t_to_base_s", lambda r: _fmt(r["time_to_baseline_loss_s"], ".1f")),
    ("speedup", lambda r: ratio_cell(r, "speedup_vs_ddp", ".2f")),
    ("speedup_to_loss", lambda r: _fmt(r["time_to_loss_speedup_vs_ddp"], ".2f")),
)


#: Shown where a record has it (``compare_columns``): the slowest position of the period over
#: the machine's bound of a step (``machine_bound_s``, ``metrics.py``).
_BOUND_COLUMN = ("worst/bound", lambda r: _fmt(r.get("worst_phase_over_bound"), ".2f"))


def compare_columns(records: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
    """``_COMPARE_COLUMNS``, with ``worst/bound`` after ``worst/compute`` where a record has a
    period and the machine's bound (records from before it was measured keep their table)."""
    columns = list(_COMPARE_COLUMNS)
    if any(r.get("worst_phase_over_bound") is not None for r in records):
        at = next(i for i, (name, _) in enumerate(columns) if name == "worst/compute") + 1
        columns.insert(at, _BOUND_COLUMN)
    return columns


def render_table(records: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    return render(records, compare_columns(records), markdown=markdown)


def plot_loss_vs_time(
    records: Sequence[dict[str, Any]], path: str | Path, *, title: str = ""
) -> None:
    """PNG/SVG/PDF (by extension) of smoothed training loss against wall time, one line each."""
    import matplotlib

    matplotlib.use("Agg")  # headless machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in records:
        ax.plot(r["wall_curve_s"], r["loss_curve"], label=r["strategy"], linewidth=1.6)
    base = records[0].get("baseline")
    target = next((r["final_loss"] for r in records if r["strategy"] == base), None)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"{base} final loss")
    ax.set_xlabel("wall time (s, training steps only)")
    ax.set_ylabel("training loss (mean over ranks, moving average)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss_vs_bytes(
    records: Sequence[dict[str, Any]], path: str | Path, *, title: str = ""
) -> None:
    """PNG/SVG/PDF (by extension) of each strategy's held-out loss against the mean bytes one
    rank hands to collectives per step (log scale): one marker per strategy, the frontier (no
    other strategy has both fewer bytes and a lower loss) joined by a line, the baseline's loss
    dashed. A strategy given in several records (runs of several seeds) is drawn at the median
    of each axis, its runs as small points beside it. The A/A control's rerun is left out (its
    loss and bytes are the baseline's).

    Raises:
        ValueError: when no record has a held-out loss.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless machines
    import matplotlib.pyplot as plt

    runs: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if "control_of" in r or r.get("eval_loss") is None:
            continue
        runs.setdefault(r["strategy"], []).append((r["bytes_per_step"] / 1e6, r["eval_loss"]))
    if not runs:
        raise ValueError("no record has a held-out loss (eval_loss) to plot against bytes")
    medians = {
        name: (statistics.median(b for b, _ in points), statistics.median(x for _, x in points))
        for name, points in runs.items()
    }
    # The legend sits right of the axes: widen the figure with its longest name (about 0.055
    # inch a character at size 7) so that the axes keep their width.
    width = max(8.5, 5.5 + 0.055 * max(len(name) for name in medians))
    fig, ax = plt.subplots(figsize=(width, 5.0))
    # 9 markers against 20 colours: no two of up to 180 strategies look alike.
    markers, colours = "osD^v<>p*", plt.get_cmap("tab20")
    for i, (name, (mb, loss)) in enumerate(medians.items()):
        style: dict[str, Any] = {"marker": markers[i % len(markers)], "color": colours(i % 20)}
        style["linestyle"] = ""
        ax.plot([mb], [loss], markersize=8, label=name, **style)
        if len(runs[name]) > 1:
            ax.plot(
                [b for b, _ in runs[name]],
                [x for _, x in runs[name]],
                markersize=4,
                alpha=0.4,
                **style,
            )
    frontier = pareto_frontier(medians)
    ax.plot(
        [medians[n][0] for n in frontier],
        [medians[n][1] for n in frontier],
        color="grey",
        linewidth=1,
        drawstyle="steps-post",  # between two of its points the loss of the cheaper one holds
        zorder=0,
        label="frontier (fewest bytes for its loss)",
    )
    base = records[0].get("baseline")
    if base in medians:
        ax.axhline(
            medians[base][1], color="black", linestyle="--", linewidth=0.8, label=f"{base} loss"
        )
    ax.set_xscale("log")
    ax.set_xlabel("MB per step one rank hands to collectives (mean over the run, log scale)")
    ax.set_ylabel("held-out loss of the model the run returns")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto_frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names of ``points`` (name: (bytes, loss)) that no other point beats on both axes
    (fewer or equal bytes and a lower loss, or fewer bytes and an equal loss), by bytes."""
    ordered = sorted(points, key=lambda n: (points[n][0], points[n][1]))
    frontier: list[str] = []
    for name in ordered:
        if not frontier or points[name][1] < points[frontier[-1]][1]:
            frontier.append(name)
    return frontier

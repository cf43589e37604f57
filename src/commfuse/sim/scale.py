"""Scaling curves: a step, or one collective per algorithm, from a few ranks to thousands."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commfuse.sim.cluster import ClusterModel
from commfuse.sim.model import ModelProfile
from commfuse.sim.network import collective_time_s
from commfuse.sim.plan import CommPlan
from commfuse.sim.step import simulate_step


def step_curve(
    cluster: ClusterModel,
    make_workload: Callable[[int], ModelProfile],
    plans: dict[str, CommPlan],
    ranks: Sequence[int],
) -> list[dict[str, Any]]:
    """One record per (ranks, plan): the predicted step and its breakdown."""
    records = []
    for p in ranks:
        sized = cluster.with_ranks(p)
        for label, plan in plans.items():
            result = simulate_step(sized, make_workload(p), plan)
            records.append({"ranks": p, "series": label, **result.as_dict()})
    return records


def collective_curve(
    cluster: ClusterModel, collective: str, algos: Sequence[str], nbytes: int, ranks: Sequence[int]
) -> list[dict[str, Any]]:
    """One record per (ranks, algorithm): one collective's time on an idle network."""
    return [
        {
            "ranks": p,
            "series": algo,
            "step_us": collective_time_s(collective, algo, nbytes, cluster.with_ranks(p)) * 1e6,
        }
        for p in ranks
        for algo in algos
    ]


def plot_curve(records: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> None:
    """Time against ranks (log-log), one line per series."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for s in dict.fromkeys(r["series"] for r in records):
        points = sorted((r["ranks"], r["step_us"] / 1e3) for r in records if r["series"] == s)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted time (ms)")
    ax.set_title(title or "commfuse simulate")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

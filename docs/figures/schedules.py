"""Draw the schedule figures of the docs: python docs/figures/schedules.py (writes the PNGs here).

Both are the textbook schedules the docs explain, drawn from their cost formulas (no
measurement): a fused operator's chunk pipeline against its unfused form, and a linear-pipeline
broadcast's blocks moving down a chain of ranks.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
COMPUTE, COMM = "#4C72B0", "#DD8452"


def fused_pipeline(path: Path, compute: float = 4.0, comm: float = 5.0, chunks: int = 4) -> None:
    """Unfused (compute all, then send all) against k chunks (send chunk i while computing
    chunk i + 1): about max(C, M) + min(C, M) / k instead of C + M."""
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.2), sharex=True)
    unfused, fused = axes
    unfused.broken_barh([(0, compute)], (10, 8), color=COMPUTE, edgecolor="white")
    unfused.broken_barh([(compute, comm)], (0, 8), color=COMM, edgecolor="white")
    unfused.set_title(f"unfused: C + M = {compute + comm:g}", fontsize=9, loc="left")
    c, m = compute / chunks, comm / chunks
    link_free = 0.0
    for i in range(chunks):
        start = i * c
        fused.broken_barh([(start, c)], (10, 8), color=COMPUTE, edgecolor="white")
        send = max(start + c, link_free)
        fused.broken_barh([(send, m)], (0, 8), color=COMM, edgecolor="white")
        fused.text(start + c / 2, 14, str(i), ha="center", va="center", color="white", fontsize=8)
        fused.text(send + m / 2, 4, str(i), ha="center", va="center", color="white", fontsize=8)
        link_free = send + m
    fused.set_title(
        f"fused, k = {chunks}: {link_free:g} (bound max(C, M) = {max(compute, comm):g})",
        fontsize=9,
        loc="left",
    )
    for ax in axes:
        ax.set_yticks([4, 14], ["collective", "compute"])
        ax.set_ylim(-1, 19)
        ax.grid(True, axis="x", alpha=0.3)
    fused.set_xlabel("time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pipeline_broadcast(path: Path, ranks: int = 4, blocks: int = 6) -> None:
    """A linear-pipeline broadcast: block j leaves rank p for rank p + 1 at step p + j, so the
    last block arrives after P - 1 + n/b steps (Wang et al., arXiv 1611.04255)."""
    fig, ax = plt.subplots(figsize=(8, 2.6))
    cmap = plt.get_cmap("viridis", blocks)
    for p in range(ranks - 1):
        for j in range(blocks):
            ax.broken_barh([(p + j, 1)], (ranks - 2 - p, 0.8), color=cmap(j), edgecolor="white")
            ax.text(
                p + j + 0.5,
                ranks - 2 - p + 0.4,
                str(j),
                ha="center",
                va="center",
                color="white",
                fontsize=8,
            )
    ax.set_yticks(
        [ranks - 2 - p + 0.4 for p in range(ranks - 1)],
        [f"rank {p} -> {p + 1}" for p in range(ranks - 1)],
    )
    ax.set_xlabel(f"step (each: alpha + b beta); total P - 1 + n/b = {ranks - 1 + blocks}")
    ax.set_title(
        f"linear pipeline broadcast, P = {ranks}, n/b = {blocks} blocks", fontsize=9, loc="left"
    )
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    fused_pipeline(HERE / "fused_pipeline.png")
    pipeline_broadcast(HERE / "pipeline_broadcast.png")

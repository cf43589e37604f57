"""Checkpoints that let ``--resume`` continue a run exactly.

Layout: ``DIR/step-000040/rank0.pt ... rankN.pt`` and ``DIR/latest`` (the last complete step).
Every rank saves its own file, because some state differs per rank: error-feedback residuals,
compressor state, RNG streams. Each file holds the model and optimizer state, the strategy's
state, the step (which is also the data position: batches are a function of (seed, step, rank)),
the RNG states, the metrics so far, and the run's identity (workload, strategy, seed, world
size), which ``--resume`` checks so a checkpoint is never continued by a different run.

Files are written to a temporary name and renamed (atomic on POSIX), and ``latest`` is written
by rank 0 only after every rank has saved (a barrier), so a crash mid-save never leaves a
``latest`` pointing at a partial checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_rank(root: str | Path, step: int, rank: int, payload: dict[str, Any]) -> Path:
    """Write this rank's file for ``step`` atomically; returns its path."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def mark_latest(root: str | Path, step: int) -> None:
    """Point ``latest`` at ``step`` (rank 0, after every rank saved)."""
    tmp = Path(root) / (LATEST + ".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, Path(root) / LATEST)


def latest_step(root: str | Path) -> int | None:
    """The last complete checkpoint's step, or None when there is none."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker} is corrupt (expected a step number, got {text!r})")
    return int(text)


def load_rank(root: str | Path, step: int, rank: int) -> dict[str, Any]:
    path = step_dir(root, step) / f"rank{rank}.pt"
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is missing (was it written by fewer ranks?)")
    # Our own files, written by this program: they hold RNG states and numpy objects.
    payload: dict[str, Any] = torch.load(path, weights_only=False)
    return payload


def check_identity(saved: dict[str, Any], current: dict[str, Any], path: str | Path) -> None:
    """ValueError naming every field where the checkpoint's run differs from this one."""
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, now {value!r}"
        for key, value in current.items()
        if saved.get(key) != value
    ]
    if diffs:
        raise ValueError(f"cannot resume from {path}: a different run (" + "; ".join(diffs) + ")")

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

Files load with ``torch.load(weights_only=True)``: a checkpoint copied from elsewhere cannot run
code when it is opened (a full unpickler calls whatever a pickle names). So what is saved is
tensors, dicts, lists, tuples, numbers, strings and None only; the RNG states of numpy (a
tuple holding an array) and Python are turned into those by :func:`rng_state`, and a file that
holds anything else is refused with a ValueError naming it.

A file loads onto the rank's device (``load_rank(..., device=comm.device)``): the model's and
the strategy's tensors (error-feedback residuals, local-SGD anchors, PowerSGD's memories) are
moved there, so a run saved on one device resumes on another. The optimizer's state is left to
``Optimizer.load_state_dict``, which puts each tensor beside its parameter by torch's own rule
(Adam's ``step`` counter stays on the host unless the optimizer is fused or capturable). The
RNG states stay host memory, where torch and numpy keep them.

RNG streams saved: torch's CPU generator, Python's ``random``, numpy's global generator, and,
when this process has used CUDA, the current CUDA device's generator (a rank drives one device).
"""

from __future__ import annotations

import os
import pickle
import random
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

_LATEST = "latest"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def numpy_rng_to_dict(state: tuple[Any, ...] | dict[str, Any]) -> dict[str, Any]:
    """A numpy ``RandomState.get_state()`` as tensors and numbers (loadable weights-only)."""
    if isinstance(state, dict):  # numpy's dict form (legacy=False)
        raise ValueError("expected numpy's legacy MT19937 state tuple")
    name, keys, pos, has_gauss, cached_gaussian = state
    if name != "MT19937":
        raise ValueError(f"numpy RNG state of {name!r} is not MT19937")
    return {
        # uint32 words stored as int64: every value fits, and int64 is a plain tensor dtype.
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def numpy_rng_from_dict(state: dict[str, Any]) -> tuple[Any, ...]:
    """The inverse of :func:`numpy_rng_to_dict`: a tuple for ``RandomState.set_state``."""
    keys = state["keys"].cpu().numpy().astype(np.uint32)
    return ("MT19937", keys, state["pos"], state["has_gauss"], state["cached_gaussian"])


def rng_state() -> dict[str, Any]:
    """This process's RNG states (see the module docstring), loadable weights-only."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),  # (version, tuple of 625 ints, None): plain data
        "numpy": numpy_rng_to_dict(np.random.get_state()),
    }
    # Only when CUDA is in use here: querying it otherwise would create a context on a
    # device this rank never touches.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
        state["cuda"] = {"device": device, "state": torch.cuda.get_rng_state(device)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved (a CUDA state needs CUDA here; warns otherwise)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(numpy_rng_from_dict(state["numpy"]))
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda["state"], cuda["device"])
        else:
            warnings.warn(
                "the checkpoint holds a CUDA RNG state but CUDA is not available here: "
                "random draws on the GPU will not continue the saved stream",
                stacklevel=2,
            )


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
    tmp = Path(root) / (_LATEST + ".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, Path(root) / _LATEST)


def latest_step(root: str | Path) -> int | None:
    """The last complete checkpoint's step, or None when there is none."""
    marker = Path(root) / _LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker} is corrupt (expected a step number, got {text!r})")
    return int(text)


#: The parts of a checkpoint ``load_rank`` moves onto the rank's device (the module docstring:
#: the optimizer places its own state; RNG states, history and identity are host data).
_ON_DEVICE = ("model", "strategy")


def load_rank(root: str | Path, step: int, rank: int, *, device: torch.device) -> dict[str, Any]:
    """Rank ``rank``'s file for ``step``, its ``_ON_DEVICE`` parts moved onto ``device``.

    Raises:
        ValueError: the file is missing or not a loadable checkpoint (``_load_file``).
    """
    path = step_dir(root, step) / f"rank{rank}.pt"
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is missing (was it written by fewer ranks?)")
    payload = _load_file(path)
    for key in _ON_DEVICE:
        if key in payload:
            payload[key] = _to_device(payload[key], device)
    return payload


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (through dicts, lists and tuples) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_device(item, device) for item in value)
    return value


def load_identity(root: str | Path, step: int) -> dict[str, Any]:
    """The run identity rank 0's file for ``step`` was saved with, read without loading its
    tensors (memory-mapped): a launcher checks it before it starts any rank.

    Raises:
        ValueError: the file is missing or not a loadable checkpoint (``_load_file``).
    """
    path = step_dir(root, step) / "rank0.pt"
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is missing")
    identity: dict[str, Any] = _load_file(path, mmap=True).get("identity", {})
    return identity


def _load_file(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """Load one checkpoint file weights-only: tensors and plain data, never code (``mmap``:
    tensors stay in the file until read).

    Raises:
        ValueError: the file holds something else (an object whose unpickling would call a
            function it names), or is not a checkpoint at all.
    """
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        raise ValueError(f"{path} is not a readable checkpoint (not a torch.save file)")
    try:
        # Onto the host first: ``load_rank`` moves what belongs on the device.
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        # torch's message is a page of advice on loading the file anyway; keep its reason.
        reason = next(
            (
                line.strip().split(". Please")[0]
                for line in str(err).splitlines()
                if "WeightsUnpickler error:" in line
            ),
            type(err).__name__,
        )
        raise ValueError(
            f"refusing to load {path}: it holds more than tensors and plain data, and a "
            f"checkpoint must not run code when it is opened ({reason})"
        ) from None
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"{path} is not a readable checkpoint: {err}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path} is not a commfuse checkpoint (got a {type(payload).__name__})")
    return payload


class DifferentRun(ValueError):
    """``check_identity``'s refusal: the checkpoint in ``path`` is of another run, which
    differs in ``diffs``: (field, the checkpoint's value, this run's) for each."""

    def __init__(self, path: str | Path, diffs: list[tuple[str, Any, Any]]) -> None:
        super().__init__(path, diffs)  # ``args``: it pickles (a rank's error reaches the launcher)
        self.path = path
        self.diffs = diffs

    def __str__(self) -> str:
        fields = "; ".join(
            f"{key}: checkpoint {old!r}, now {new!r}" for key, old, new in self.diffs
        )
        return f"cannot resume from {self.path}: a different run ({fields})"


def check_identity(saved: dict[str, Any], current: dict[str, Any], path: str | Path) -> None:
    """``DifferentRun`` (a ValueError) naming every field where the checkpoint's run differs
    from this one."""
    diffs = [
        (key, saved.get(key), value) for key, value in current.items() if saved.get(key) != value
    ]
    if diffs:
        raise DifferentRun(path, diffs)

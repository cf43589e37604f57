"""What runs inside a rank process started by ``run`` or the test pool: set up, report back.

Results and exceptions travel from a rank to the process that started it (its own parent, on
the same machine) by pickle over a private pipe. Nothing a rank receives from *another rank*
is ever unpickled: ranks exchange only tensors through the process group.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import traceback
from collections.abc import Mapping
from typing import Any

from commfuse.cluster.errors import RankError

_PackedError = tuple[str, str, bytes | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommSettings:
    """What the launcher's environment tells this rank's communicators: the ``CommConfig``
    fields of the same names (None: not set, the field's default holds). Read once, when the
    rank starts (``enter_rank``); ``commfuse.comm`` builds its default config from it."""

    deadline_s: float | None = None
    """``COMMFUSE_DEADLINE_S``."""
    link_mbit: float | None = None
    """``COMMFUSE_LINK_MBIT``: the emulated host links' rate."""
    ranks_per_host: int | None = None
    """``LOCAL_WORLD_SIZE`` (torchrun's): ranks on this rank's host."""
    tuner_profile_path: str | None = None
    """``COMMFUSE_TUNER_PROFILE``: a profile saved by ``commfuse tune``."""
    tuner_trial_calls: int | None = None
    """``COMMFUSE_TUNER_TRIAL_CALLS``: timed calls per candidate of ``algo="auto"``'s trial at
    first use (0: off)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CommSettings:
        """Parse the variables; ValueError naming the variable whose value is not a number."""

        def number(name: str, kind: type[float] | type[int], *, zero: bool = False) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}"
                ) from None
            if not (value >= 0 if zero else value > 0):
                raise ValueError(f"{name}={raw!r} must be {'>=' if zero else '>'} 0")
            return value

        return cls(
            deadline_s=number("COMMFUSE_DEADLINE_S", float),
            link_mbit=number("COMMFUSE_LINK_MBIT", float),
            ranks_per_host=number("LOCAL_WORLD_SIZE", int),
            tuner_profile_path=env.get("COMMFUSE_TUNER_PROFILE") or None,
            tuner_trial_calls=number("COMMFUSE_TUNER_TRIAL_CALLS", int, zero=True),
        )


_comm_settings: CommSettings | None = None


def comm_settings() -> CommSettings:
    """This rank's settings, read from its environment once per process: by ``enter_rank`` in
    a rank that ``commfuse run`` or the test pool started, else the first time a communicator
    asks for them (a script that ``commfuse launch`` or torchrun started builds its first
    ``Communicator`` after ``init_process_group``, when the launcher's variables are set), so
    every way of starting a rank honours ``COMMFUSE_DEADLINE_S`` and the rest.

    Raises:
        ValueError: a variable that is set is not a valid number (the message names it).
    """
    if _comm_settings is None:
        return _load_comm_settings()
    return _comm_settings


def _load_comm_settings(env: Mapping[str, str] | None = None) -> CommSettings:
    """Read this rank's ``CommSettings`` from ``env`` (default: the process environment), and
    keep them for every communicator built afterwards (``comm_settings``).

    Raises:
        ValueError: a variable that is set is not a valid number (the message names it).
    """
    global _comm_settings
    _comm_settings = CommSettings.from_env(os.environ if env is None else env)
    return _comm_settings


def enter_rank(env: dict[str, str], netns: str | None) -> None:
    """Adopt the rank's environment (reading the communicators' settings from it, once) and,
    when emulated, its host's network namespace."""
    # ``env`` is the caller's whole environment with the rank's variables: it replaces the
    # process's own, which a rank forked from the start server inherited from that server.
    os.environ.clear()
    os.environ.update(env)
    _load_comm_settings()
    # torch reads OMP_NUM_THREADS when it is first imported, which for a rank happened in the
    # start server or while the target function was unpickled; set the pool size explicitly,
    # as torchrun's workers get it. With 2 threads per rank on 2 cores, reductions inside our
    # algorithms ran 5-10x slower (measured: 16 MB LP reduce on 4 ranks, 72 ms -> 420+ ms).
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if netns is not None:
        from commfuse.cluster.netns import enter_netns

        enter_netns(netns)


def init_default_group(backend: str = "gloo", *, timeout_s: float = 60.0) -> None:
    """``init_process_group`` from the torchrun environment, with a bounded backend timeout."""
    import torch
    import torch.distributed as dist

    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def pack_exception(exc: BaseException) -> _PackedError:
    """(one-line summary, formatted traceback, the pickled exception or None)."""
    summary = f"{type(exc).__name__}: {exc}"
    text = "".join(traceback.format_exception(exc))
    blob: bytes | None
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    return summary, text, blob


def unpack_exception(rank: int, packed: _PackedError) -> RankError:
    summary, text, blob = packed
    exc: Any = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    err = RankError(rank, summary, remote_traceback=text, exc=exc)
    return err

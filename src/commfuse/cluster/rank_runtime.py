"""What runs inside a rank process started by ``run`` or the test pool: set up, report back.

Results and exceptions travel from a rank to the process that started it (its own parent, on
the same machine) by pickle over a private pipe. Nothing a rank receives from *another rank*
is ever unpickled: ranks exchange only tensors through the process group.
"""

from __future__ import annotations

import datetime
import os
import pickle
import traceback
from typing import Any

from commfuse.cluster.errors import RankError

PackedError = tuple[str, str, bytes | None]


def enter_rank(env: dict[str, str], netns: str | None) -> None:
    """Adopt the rank's environment and, when emulated, its host's network namespace."""
    os.environ.update(env)
    # torch reads OMP_NUM_THREADS when it is first imported, which in a spawned rank happens
    # while the target function is unpickled, before this runs; set the pool size explicitly,
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


def pack_exception(exc: BaseException) -> PackedError:
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


def unpack_exception(rank: int, packed: PackedError) -> RankError:
    summary, text, blob = packed
    exc: Any = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    err = RankError(rank, summary, remote_traceback=text, exc=exc)
    return err

"""How many pieces to cut a fused operator into: the overlap cost model and its measured inputs.

A fused operator (Punniyamurthy, Hamidouche and Beckmann, SC24, arXiv 2305.06942) computes its
result in ``k`` chunks and starts the collective of chunk ``i`` while chunk ``i + 1`` is computed.
With compute time ``C`` and communication time ``M`` for the whole operator, and a fixed cost
``o`` per chunk (one more kernel launch, one more collective's latency), the time is about

    T(k) = max(C, M) + min(C, M) / k + k * o

1. The longer of the two streams runs end to end; only the first chunk of the shorter one (or
   its last) cannot hide behind the other, which is the ``min(C, M) / k`` term.
2. ``dT/dk = 0`` gives ``k* = sqrt(min(C, M) / o)``; the integer neighbours are compared.
3. ``k = 1`` is the unfused operator (``T = C + M``). Chunking is chosen only when the model
   predicts it saves at least ``min_gain`` of the unfused time, so the operator falls back to one
   chunk when one side is negligible or the per-chunk overhead eats the gain.

Every rank must cut the same number of chunks (each chunk is a collective), so the measured times
are agreed with one tiny all-reduce (max over ranks) before ``k`` is chosen (``agree_chunks``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final, Literal

import torch

from commfuse.comm import Communicator
from commfuse.comm.clock import elapsed_us, now

#: The embedding exchange's second schedule: one table at a time instead of sample chunks.
BY_TABLE: Final = "by_table"
ChunkSchedule = int | Literal["by_table"]
"""How a fused operator is cut: into a number of chunks, or (the embedding exchange only) table
by table (``BY_TABLE``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    """How a fused operator chooses its number of chunks (or, for the embedding exchange, its
    schedule)."""

    num_chunks: int | None = None
    """Fixed number of chunks (>= 1); None chooses it from measured compute and communication
    times."""
    schedule: Literal["by_table"] | None = None
    """``"by_table"``: the embedding exchange looks up and sends one table at a time
    (``embedding_all_to_all.py``), a schedule only it has; None: chunks, fixed by
    ``num_chunks`` or chosen (the embedding exchange's choice may still pick by table)."""
    max_chunks: int = 16
    """Upper bound of the automatic choice."""
    overhead_us: float | None = None
    """Per-chunk overhead o in microseconds; None measures it (one tiny collective)."""
    min_gain: float = 0.05
    """Chunk only when the model predicts at least this fraction less time than one chunk."""
    reference_algo: str | None = None
    """The ``commfuse.collectives`` algorithm of the AllGather / ReduceScatter that the
    sequence-parallel linears' unfused reference runs (one chunk, or chosen when chunking does
    not pay), e.g. ``"native"`` to count its bytes under the backend's collective names; None:
    ``baselines.SEQUENCE``. Only those references take one (``require_chunks``)."""

    def fixed(self) -> ChunkSchedule | None:
        """The schedule the caller fixed (``schedule`` or ``num_chunks``); None: choose it."""
        return self.schedule if self.schedule is not None else self.num_chunks

    def require_chunks(
        self, operator: str, *, by_table: bool = False, reference_algo: bool = False
    ) -> None:
        """ValueError for what ``operator`` does not have: a by-table schedule (unless
        ``by_table``), an unfused reference whose algorithm can be chosen (unless
        ``reference_algo``)."""
        if self.schedule is not None and not by_table:
            raise ValueError(
                f"ChunkConfig.schedule={self.schedule!r} is the embedding exchange's schedule; "
                f"{operator} takes num_chunks only"
            )
        if self.reference_algo is not None and not reference_algo:
            raise ValueError(
                f"ChunkConfig.reference_algo={self.reference_algo!r} is for the sequence-parallel "
                f"linears' references; {operator}'s reference runs a fixed collective "
                "(fused/baselines.py)"
            )

    def __post_init__(self) -> None:
        if self.num_chunks is not None and (
            isinstance(self.num_chunks, bool)
            or not isinstance(self.num_chunks, int)
            or self.num_chunks < 1
        ):
            raise ValueError(
                f"ChunkConfig.num_chunks must be >= 1 or None (automatic), got "
                f"{self.num_chunks!r} (the embedding exchange by table is schedule='by_table')"
            )
        if self.schedule not in (None, BY_TABLE):
            raise ValueError(
                f"ChunkConfig.schedule must be None or {BY_TABLE!r}, got {self.schedule!r}"
            )
        if self.schedule is not None and self.num_chunks is not None:
            raise ValueError(
                f"ChunkConfig: schedule={self.schedule!r} has no chunks; leave num_chunks None"
            )
        if self.max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {self.max_chunks}")
        if self.overhead_us is not None and self.overhead_us < 0:
            raise ValueError(f"overhead_us must be >= 0, got {self.overhead_us}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")


def predict_us(compute_us: float, comm_us: float, chunks: int, overhead_us: float) -> float:
    """The model ``max(C, M) + min(C, M) / k + k * o`` (microseconds)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return max(compute_us, comm_us) + min(compute_us, comm_us) / chunks + chunks * overhead_us


def choose_chunks(
    compute_us: float,
    comm_us: float,
    overhead_us: float,
    *,
    max_chunks: int = 16,
    min_gain: float = 0.05,
) -> int:
    """The ``k`` in ``[1, max_chunks]`` that minimises the model, or 1 when chunking cannot pay."""
    if min(compute_us, comm_us) <= 0 or max_chunks <= 1:
        return 1
    best_k = 1
    if overhead_us <= 0:
        best_k = max_chunks
    else:
        root = math.sqrt(min(compute_us, comm_us) / overhead_us)
        candidates = {max(1, min(max_chunks, k)) for k in (math.floor(root), math.ceil(root))}
        best_k = min(candidates, key=lambda k: predict_us(compute_us, comm_us, k, overhead_us))
    unfused = predict_us(compute_us, comm_us, 1, overhead_us)
    if predict_us(compute_us, comm_us, best_k, overhead_us) > (1.0 - min_gain) * unfused:
        return 1
    return best_k


def agree_chunks(
    comm: Communicator,
    compute_us: float,
    comm_us: float,
    overhead_us: float,
    config: ChunkConfig,
    *,
    limit: int,
) -> int:
    """``choose_chunks`` on times agreed across ranks (max), capped at ``limit`` pieces.

    Every rank must call it at the same point: it issues one all-reduce of three numbers."""
    if config.num_chunks is not None:
        return max(1, min(config.num_chunks, max(limit, 1)))
    times = torch.tensor(
        [compute_us, comm_us, overhead_us], dtype=torch.float64, device=comm.device
    )
    comm.all_reduce(times, "max")
    c, m, o = times.tolist()
    return choose_chunks(
        c, m, o, max_chunks=min(config.max_chunks, max(limit, 1)), min_gain=config.min_gain
    )


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes differing by at most one, larger first."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` of ``split_sizes(total, parts)``: a rank's shard."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``split_sizes`` as ``(start, stop)`` ranges, empty ranges dropped (at least one kept)."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for size in split_sizes(total, parts):
        if size:
            ranges.append((start, start + size))
        start += size
    return ranges or [(0, 0)]


def measure_overhead_us(comm: Communicator, repeats: int = 3) -> float:
    """The per-chunk overhead o: the median time of a one-element all-reduce (one collective's
    latency and launch cost; the extra kernel launch per chunk is small beside it on gloo)."""
    if comm.world_size == 1:
        return 0.0
    token = torch.zeros(1, device=comm.device)
    times = []
    for _ in range(repeats):
        start = now(comm.device)
        comm.all_reduce(token)
        times.append(elapsed_us(start, comm.device))
    return sorted(times)[len(times) // 2]

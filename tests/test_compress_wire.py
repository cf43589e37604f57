"""The all-gather compressors on real process groups, checked against what went on the wire.

For int8, int4, QSGD, TernGrad, sign, EF-sign, top-k, DGC, SparseLoCo and DeMo, over several steps on 2 and 3 ranks:

1. every rank records the words the all-gather delivered (the real collective runs; the record
   is a copy of its output), and the test's own decoder (``wire_decode.py``, float64, no code
   shared with the compressors) turns each rank's message into the vector it stands for: the
   compressor's output must be their average;
2. this rank's own message must be what the compressor's paper sends for this step's input,
   which the test tracks itself in float64 (the gradient plus the error-feedback residual; for
   DGC the momentum-corrected accumulation with its masking): int8's scale is ``max|x| / 127``
   and every element is within half a step; QSGD's and TernGrad's norms are each chunk's L2
   norm or max and every element is within one level; sign's scale is ``mean|x|`` with the
   signs of x; top-k and DGC keep k entries, none smaller than any left behind, with their
   exact values.

Gradients are Gaussian (different scales per rank, no ties), so a decoder that mixed up two
ranks' scales, or an encoder that dropped the residual, would show.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import wire_decode
from commfuse.comm import Communicator
from commfuse.compress import (
    DGC,
    QSGD,
    DeMo,
    EFSign,
    Int4,
    Int8,
    MessageCompressor,
    Sign,
    SparseLoCo,
    TernGrad,
    TopK,
)

NUMEL = 1001
STEPS = 5


def compressors() -> list[MessageCompressor]:
    common: dict[str, Any] = {"gather_algo": "native"}
    return [
        Int8(**common),
        QSGD(**common),
        QSGD(levels=16, chunk_numel=64, ef=True, **common),
        TernGrad(chunk_numel=100, **common),
        Sign(**common),
        EFSign(**common),
        TopK(ratio=0.05, **common),
        DGC(ratio=0.01, warmup=3, momentum=0.9, **common),
        Int4(chunk_numel=100, **common),
        SparseLoCo(chunk_numel=128, num_kept_per_chunk=9, decay=0.9, **common),
        DeMo(chunk_numel=32, num_kept_per_chunk=3, decay=0.8, **common),
    ]


def gradient(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(NUMEL, generator=g) * (1.0 + rank) + 0.1 * step


class Tracker:
    """The input the compressor should encode at each step, tracked in float64 from the
    decoded messages (the paper's algorithm, written again here)."""

    def __init__(self, c: MessageCompressor) -> None:
        self.c = c
        self.residual = np.zeros(NUMEL)
        self.momentum = np.zeros(NUMEL)

    def input(self, grad: torch.Tensor) -> np.ndarray[Any, np.dtype[np.float64]]:
        g = grad.double().numpy()
        if isinstance(self.c, DGC):
            self.momentum = self.c.momentum * self.momentum + g
            return self.residual + self.momentum
        decay = float(getattr(self.c, "decay", 1.0))
        return decay * self.residual + g if self.c.ef else g

    def sent(
        self,
        x: np.ndarray[Any, np.dtype[np.float64]],
        decoded: np.ndarray[Any, np.dtype[np.float64]],
    ) -> None:
        if isinstance(self.c, DGC):
            kept = decoded != 0
            self.residual = np.where(kept, 0.0, x)
            self.momentum = np.where(kept, 0.0, self.momentum)
        elif self.c.ef:
            self.residual = x - decoded


def encoder_problems(
    c: MessageCompressor, message: bytes, x: np.ndarray[Any, np.dtype[np.float64]], step: int
) -> list[str]:
    """What is wrong with ``message`` as the paper's encoding of ``x`` (empty: nothing)."""
    fields = wire_decode.parse(c, message, NUMEL, step)
    decoded = wire_decode.decode(c, message, NUMEL, step)
    tol = 1e-5
    problems = []
    if c.name == "int8":
        scale = float(fields[0][0])
        if not np.isclose(scale, np.abs(x).max() / 127, rtol=tol):
            problems.append(f"scale {scale}, max|x| / 127 = {np.abs(x).max() / 127}")
        if np.abs(decoded - x).max() > scale / 2 * (1 + tol):
            problems.append(f"an element is off by {np.abs(decoded - x).max()} > scale / 2")
    elif c.name in ("qsgd", "terngrad"):
        chunk = c.chunk_numel  # type: ignore[attr-defined]
        padded = np.zeros(-(-NUMEL // chunk) * chunk)
        padded[:NUMEL] = x
        rows = padded.reshape(-1, chunk)
        norms = np.abs(rows).max(1) if c.name == "terngrad" else np.linalg.norm(rows, axis=1)
        if not np.allclose(fields[0], norms, rtol=tol):
            problems.append(f"norms {fields[0][:3]}..., the chunks' {norms[:3]}...")
        step_size = np.repeat(norms, chunk)[:NUMEL] / c.levels  # type: ignore[attr-defined]
        if (np.abs(decoded - x) > step_size * (1 + tol)).any():
            problems.append("an element is off by more than one level")
    elif c.name in ("sign", "ef-sign"):
        scale = float(fields[0][0])
        if not np.isclose(scale, np.abs(x).mean(), rtol=tol):
            problems.append(f"scale {scale}, mean|x| = {np.abs(x).mean()}")
        if ((decoded > 0) != (x >= 0)).any():
            problems.append("a sign differs from x's")
    elif c.name == "int4":
        size = c.chunk_numel  # type: ignore[attr-defined]
        magnitudes = np.zeros(-(-NUMEL // size) * size)
        magnitudes[:NUMEL] = np.abs(x)
        scales = magnitudes.reshape(-1, size).max(1) / 7
        if not np.allclose(fields[0], scales, rtol=tol):
            problems.append(f"scales {fields[0][:3]}..., max|x| / 7 {scales[:3]}...")
        if (np.abs(decoded - x) > np.repeat(scales, size)[:NUMEL] / 2 * (1 + tol)).any():
            problems.append("an element is off by more than half a step")
    elif c.name in ("sparseloco", "demo"):
        num_rows, chunk, k = wire_decode.rows_chunk_k(c, NUMEL)
        flat = np.zeros(num_rows * chunk)
        flat[:NUMEL] = x
        matrix = flat.reshape(num_rows, chunk)
        index = fields[1].astype(np.int64).reshape(num_rows, k)
        for row in range(num_rows):
            values = matrix[row]
            if c.name == "demo":
                eye = np.eye(chunk)
                values = np.array([wire_decode.inverse_dct(eye[i]) for i in range(chunk)]) @ values
            kept = np.zeros(chunk, dtype=bool)
            kept[index[row]] = True
            if kept.sum() != k:
                problems.append(f"row {row}: {kept.sum()} distinct indices, k = {k}")
            elif not kept.all() and np.abs(values[kept]).min() < np.abs(values[~kept]).max() * (
                1 - tol
            ):
                problems.append(f"row {row}: a kept entry is smaller than one left behind")
            chosen = values[index[row]]
            if c.name == "demo":
                if not np.allclose(fields[0].reshape(num_rows, k)[row], chosen, rtol=tol, atol=tol):
                    problems.append(f"row {row}: a kept coefficient is not the DCT's")
                continue
            levels = fields[0][2 * row], fields[0][2 * row + 1]
            magnitude = np.abs(chosen)
            lo, hi = magnitude.min(), magnitude.max()
            high = magnitude * 2 >= lo + hi
            means = (
                magnitude[~high].mean() if (~high).any() else lo,
                magnitude[high].mean() if high.any() else hi,
            )
            if not np.allclose(levels, means, rtol=tol, atol=tol):
                problems.append(f"row {row}: levels {levels} are not the groups' means {means}")
            got = decoded[row * chunk + index[row][index[row] + row * chunk < NUMEL]]
            want = chosen[index[row] + row * chunk < NUMEL]
            if (np.sign(got) != np.where(want >= 0, 1, -1)).any() or (
                np.abs(got - want) > (hi - lo) / 2 * (1 + tol) + tol
            ).any():
                problems.append(f"row {row}: a value off its sign or by more than (hi - lo) / 2")
    else:  # top-k, DGC
        values, indices = fields
        kept = np.zeros(NUMEL, dtype=bool)
        kept[indices] = True
        if len(set(indices.tolist())) != len(indices) or len(indices) != wire_decode.sparse_k(
            c, NUMEL, step
        ):
            problems.append(f"{len(indices)} indices, {len(set(indices.tolist()))} distinct")
        if not np.allclose(values, x[indices], rtol=tol, atol=tol):
            problems.append("a kept value is not x's")
        if not kept.all() and np.abs(x[kept]).min() < np.abs(x[~kept]).max() * (1 - tol):
            problems.append("a kept entry is smaller than one left behind")
    return problems


def record_all_gathers(comm: Communicator) -> list[torch.Tensor]:
    """From now on, a copy of what each of ``comm``'s all-gathers delivered (the real one runs)."""
    received: list[torch.Tensor] = []
    gather = comm.all_gather

    def recording(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        result = gather(output, input, **kwargs)
        received.append(output.clone())
        return result

    comm.all_gather = recording  # type: ignore[method-assign]  # a recorder around the real one
    return received


def wire_matches_output(world_check: int) -> list[str]:
    """Run each compressor for STEPS steps; compare its output with the test's decoding of the
    recorded all-gather, and its own message with the tracked input."""
    failures: list[str] = []
    for c in compressors():
        comm = Communicator()
        assert comm.world_size == world_check
        received = record_all_gathers(comm)
        tracker = Tracker(c)
        for step in range(STEPS):
            grad = gradient(comm.rank, step)
            x = tracker.input(grad)
            out = grad.clone()
            c.reduce_(comm, out, bucket=0, step=step)
            if len(received) != step + 1:
                failures.append(f"{c.name} step {step}: {len(received) - step} all-gathers")
                break
            rows = received[-1].view(comm.world_size, -1)
            messages = [row.numpy().tobytes() for row in rows]
            name = f"{c.name}{'+ef' if c.ef else ''} step {step}"
            try:
                want = wire_decode.average(c, messages, NUMEL, step)
                mine = wire_decode.decode(c, messages[comm.rank], NUMEL, step)
            except ValueError as err:
                failures.append(f"{name}: {err}")
                break
            scale = float(np.abs(want).max()) or 1.0
            error = float(np.abs(out.double().numpy() - want).max())
            if error > 1e-5 * scale:
                failures.append(f"{name}: output differs from the wire's average by {error}")
            failures += [
                f"{name} rank {comm.rank}: {p}"
                for p in encoder_problems(c, messages[comm.rank], x, step)
            ]
            tracker.sent(x, mine)
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_output_is_the_average_of_the_messages_on_the_wire(pool: Any, world: int) -> None:
    for failures in pool(world).run(wire_matches_output, world, timeout_s=120):
        assert failures == []

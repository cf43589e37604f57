"""DeMo: decoupled momentum, sent as the top-k of its DCT per chunk.

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization" (2024). Momentum changes
slowly in some directions and fast in others; DeMo sends only the fast components and keeps the
rest in each rank's own momentum, which therefore drifts apart across ranks (decoupled). Per
exchange and rank:

1. ``m = momentum m + delta``: the rank's momentum takes this exchange's input;
2. cut ``m`` into chunks of ``chunk_numel`` elements (64) and take each chunk's orthonormal
   DCT-II (a ``chunk x chunk`` matrix product, on ``m``'s device);
3. keep the ``num_kept_per_chunk`` (4) coefficients largest in magnitude of each chunk: their
   fp32 values and their 8-bit index in the chunk;
4. ``m = m - IDCT(kept)``: the sent components leave the momentum (the DCT is orthonormal, so
   this is exactly the error feedback of the transform domain);
5. every rank gathers the messages, sums the kept coefficients and inverts the DCT: the average
   of the ranks' fast components.

The paper then steps by the sign of that average on every gradient; as an outer-gradient
compressor the average goes to the method's outer optimizer instead (DiLoCo's Nesterov SGD), so
this is DeMo's transport under any periodic method. The paper's DCT is 2-D on weight matrices;
here the chunks are runs of the flat bucket, so every tensor shape and fragment works alike.

Message per rank: per chunk ``k x (4 + 1)`` bytes, padded to words: with the defaults 20 bytes
for 256 bytes of fp32, 12.8x fewer. Tuning: ``momentum`` near 1 keeps slow components longer
(the paper's 0.999 for per-step gradients; an outer exchange comes H steps apart, so less);
fewer kept coefficients cut bytes linearly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from commfuse.compress.chunked import ChunkTopKCompressor, as_rows
from commfuse.compress.wire import Layout


def dct_matrix(
    size: int, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` (``size x size``, on ``device``): ``D @ v`` is the
    DCT of ``v`` and ``D.T @ c`` inverts it. ``D[k, n] = s_k cos(pi (2n + 1) k / (2 size))``,
    ``s_0 = sqrt(1 / size)``, ``s_k = sqrt(2 / size)``."""
    n = torch.arange(size, dtype=torch.float64, device=device)
    k = n.view(-1, 1)
    matrix = torch.cos(math.pi * (2 * n + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    matrix[0] /= math.sqrt(2.0)
    return matrix.to(dtype)


def dct_reference(row: torch.Tensor) -> torch.Tensor:
    """The orthonormal DCT-II of one row by its defining sum, in float64 (``dct_matrix``'s
    exact reference)."""
    size = row.numel()
    values = [float(v) for v in row.reshape(-1)]
    out = []
    for k in range(size):
        total = sum(
            v * math.cos(math.pi * (2 * i + 1) * k / (2 * size)) for i, v in enumerate(values)
        )
        out.append(total * math.sqrt((1.0 if k == 0 else 2.0) / size))
    return torch.tensor(out, dtype=torch.float64, device=row.device)


@dataclasses.dataclass(kw_only=True)
class DeMo(ChunkTopKCompressor):
    """Top-k DCT coefficients of a decoupled momentum per chunk, allgathered."""

    name: ClassVar[str] = "demo"
    max_chunk_numel: ClassVar[int] = 256
    """Indices inside a chunk travel as 8-bit integers."""
    chunk_numel: int = 64
    """Elements per chunk, the DCT's size (at most 256: indices are 8-bit)."""
    num_kept_per_chunk: int = 4
    """DCT coefficients sent per chunk (k)."""
    decay: float = 0.9
    """The momentum's decay per exchange (the paper's beta)."""
    ef: bool = True

    def __post_init__(self) -> None:
        self._check_chunks()
        if not self.ef:
            raise ValueError("demo: the decoupled momentum IS its error feedback; ef must be on")

    def layout(self, numel: int, dtype: torch.dtype, step: int | None) -> Layout:
        rows, _, k = self.shape(numel)
        return Layout.of((torch.float32, rows * k), (torch.uint8, rows * k))

    def compress(
        self, x: torch.Tensor, *, step: int = 0, bucket: int = 0, rank: int = 0
    ) -> list[torch.Tensor]:
        rows, chunk, k = self.shape(x.numel())
        coefficients = as_rows(x, rows, chunk) @ dct_matrix(chunk, x.device).T
        index = torch.topk(coefficients.abs(), k, dim=1, sorted=False).indices
        values = coefficients.gather(1, index)
        return [values.reshape(-1), index.to(torch.uint8).reshape(-1)]

    def decompress_sum(
        self, parts: list[torch.Tensor], numel: int, dtype: torch.dtype, step: int | None
    ) -> torch.Tensor:
        values, index = parts
        rows, chunk, k = self.shape(numel)
        ranks = values.shape[0]
        coefficients = values.new_zeros(rows, chunk)
        # The sum over ranks of the kept coefficients, then one inverse DCT (it is linear).
        positions = index.view(ranks, rows, k).long() + (
            torch.arange(rows, device=values.device).view(1, rows, 1) * chunk
        )
        coefficients.view(-1).index_add_(0, positions.reshape(-1), values.reshape(-1))
        dense = coefficients @ dct_matrix(chunk, values.device)
        return dense.reshape(-1)[:numel].to(dtype)

"""TableGradients (the table-gradient accumulation of the embedding + All-to-All backward) equals,
bit for bit, the per-table, per-block ``index_add_`` it replaced, on random float data (not
integer-valued: the order of every sum matters): sum and mean, float32 and bfloat16 gradients,
int64 and int32 ids, empty bags, ids before the first offset, zero to eight tables, blocks
accumulated out of order (the fused backward's own block first); and the result is the
gradient of ``F.embedding_bag``."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from commfuse.fused.table_gradients import TableGradients


def per_table_reference(
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    offsets: list[torch.Tensor],
    start: int,
    grad_rows: torch.Tensor,
    mode: str,
) -> None:
    """The previous implementation: one gather and one ``index_add_`` per table and block."""
    rows = grad_rows.shape[0]
    for t, (grad_w, idx, off) in enumerate(zip(grads, indices, offsets, strict=True)):
        lo = int(off[start]) if start < off.numel() else idx.numel()
        hi = int(off[start + rows]) if start + rows < off.numel() else idx.numel()
        bounds = torch.cat([off[start : start + rows], off.new_tensor([hi])])
        lengths = (bounds[1:] - bounds[:-1]).clamp_min(0)
        bag = torch.repeat_interleave(torch.arange(rows), lengths)
        g = grad_rows[:, t][bag].float()
        if mode == "mean":
            g = g / lengths[bag].unsqueeze(1)
        grad_w.index_add_(0, idx[lo:hi], g)


def random_case(
    seed: int, num_tables: int, batch: int, dim: int, itype: torch.dtype, prefix: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = [int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(num_tables)]
    tables = [torch.randn(r, dim, generator=gen) for r in rows]
    indices, offsets = [], []
    for r in rows:
        lengths = torch.randint(0, 6, (batch,), generator=gen)  # empty bags included
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]) + prefix
        ids = (torch.rand(int(lengths.sum()) + prefix, generator=gen) ** 3 * r).long()  # skewed
        indices.append(ids.to(itype))
        offsets.append(starts.to(itype))
    return tables, indices, offsets


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_per_table_index_add_bitwise(mode: str, dtype: torch.dtype) -> None:
    for seed, (num_tables, batch, dim) in enumerate(
        [(1, 1, 1), (3, 7, 5), (8, 64, 16), (0, 9, 4), (2, 300, 8), (5, 33, 3)]
    ):
        itype = torch.int32 if seed % 2 else torch.int64
        tables, indices, offsets = random_case(seed, num_tables, batch, dim, itype, seed % 3)
        gen = torch.Generator().manual_seed(100 + seed)
        grad = (torch.randn(batch, num_tables, dim, generator=gen) * 10).to(dtype)
        cuts = sorted({0, batch, batch // 3, (2 * batch) // 3})
        blocks = list(itertools.pairwise(cuts))
        blocks = blocks[1:] + blocks[:1]  # not in sample order, as in the fused backward
        want = [torch.zeros(t.shape, dtype=torch.float32) for t in tables]
        got = TableGradients(tables, indices, offsets, mode)
        by_table = TableGradients(tables, indices, offsets, mode)  # the by-table backward's way
        for lo, hi in blocks:
            per_table_reference(want, indices, offsets, lo, grad[lo:hi], mode)
            got.add(lo, grad[lo:hi])
        for t in range(num_tables):
            for lo, hi in blocks:
                by_table.add_table(t, lo, grad[lo:hi, t])
        for t, (w, g, b) in enumerate(
            zip(want, got.result(tables), by_table.result(tables), strict=True)
        ):
            assert torch.equal(w, g), f"seed {seed} table {t}: differs by {(w - g).abs().max()}"
            assert torch.equal(w, b), f"seed {seed} table {t} by table: {(w - b).abs().max()}"


def test_is_the_embedding_bag_gradient() -> None:
    tables, indices, offsets = random_case(11, 3, 20, 6, torch.int64, 0)
    grad = torch.randn(20, 5, 6)[:, 1:4]  # a strided view, as the fused backward's own block
    for mode in ("sum", "mean"):
        got = TableGradients(tables, indices, offsets, mode)
        got.add(0, grad[:8])
        got.add(8, grad[8:].contiguous())
        for t, (table, idx, off) in enumerate(zip(tables, indices, offsets, strict=True)):
            w = table.clone().requires_grad_(True)
            (F.embedding_bag(idx, w, off, mode=mode) * grad[:, t]).sum().backward()  # type: ignore[no-untyped-call]
            assert w.grad is not None
            assert torch.allclose(got.result(tables)[t], w.grad, rtol=1e-5, atol=1e-5)

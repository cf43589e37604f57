"""PowerSGD's per-tensor layout on real gloo process groups: why it exists (exact recovery of
low-rank weight gradients, which the flat layout cannot), 16-bit buckets, layout changes and
mismatches. The shared grid (averages, bytes, error feedback, resume, non-finite) runs the
layout too, in ``test_compress_ranks.py`` (the specs ending in ``+layout``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from commfuse.cli.spec import compressor_from_spec
from commfuse.comm import Communicator
from commfuse.compress import BucketLayout, PowerSGD

#: A bucket as a model packs it: weights (one 3-D), biases, a 2 x 2 matrix sent as it is.
SHAPES = [torch.Size(s) for s in ((8, 16), (16,), (4, 5, 3), (3,), (2, 2), (28, 10), (9,))]
NUMEL = sum(s.numel() for s in SHAPES)


def low_rank_errors(shapes: list[tuple[int, ...]]) -> dict[str, float]:
    """Relative error of one rank-4 PowerSGD step on weight gradients that are exactly rank 2
    per rank (so rank <= 4 summed over 2 ranks), with and without the layout."""
    comm = Communicator()
    gen = torch.Generator().manual_seed(comm.rank)
    parts = []
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape) // shape[0]
        if len(shape) >= 2:
            parts.append(
                (torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen)).view(-1)
            )
        else:
            parts.append(torch.randn(rows, generator=gen))
    grad = torch.cat(parts)
    want = grad.clone()
    comm.all_reduce(want, "avg")
    errors = {}
    for layout in (False, True):
        c = compressor_from_spec("powersgd:rank=4,warmup=0", algo="native")
        if layout:
            c.set_layout(0, BucketLayout.of_shapes([torch.Size(s) for s in shapes], prefix="b0."))
        out = grad.clone()
        c.reduce_(comm, out, bucket=0, step=0)
        errors["layout" if layout else "flat"] = float((out - want).norm() / want.norm())
    # 16-bit buckets: factors (and the plain elements packed with them) in fp32, so the
    # result is the fp32 result on the same (rounded) input, rounded once to bf16.
    half = grad.to(torch.bfloat16)
    fp32 = half.float()
    for dtype_grad in (fp32, half):
        c = compressor_from_spec("powersgd:rank=4,warmup=0", algo="native")
        c.set_layout(0, BucketLayout.of_shapes([torch.Size(s) for s in shapes], prefix="b0."))
        comm.stats.reset()
        c.reduce_(comm, dtype_grad, bucket=0, step=0)
    errors["bf16"] = float(((half.float() - fp32).abs() / fp32.abs().clamp_min(1e-3)).max())
    claimed = c.payload_bytes(grad.numel(), torch.bfloat16, comm.world_size, step=0, bucket=0)
    errors["bf16 bytes off"] = float(comm.stats.total().native_bytes - claimed)
    return errors


def test_per_tensor_layout_recovers_low_rank_weight_gradients(pool: Any) -> None:
    """The reason for the layout: a weight gradient is low-rank, a flat bucket is not."""
    shapes = [(48, 32), (48,), (32, 48), (32,), (20, 8, 4)]
    for errors in pool(2).run(low_rank_errors, shapes, timeout_s=60):
        assert errors["layout"] < 1e-5, errors
        assert errors["flat"] > 0.1, errors
        assert errors["bf16"] <= 2**-8 and errors["bf16 bytes off"] == 0, errors


def layout_changes(numel: int) -> list[str]:
    comm = Communicator()
    c = compressor_from_spec("powersgd:rank=2,warmup=0", algo="native")
    assert isinstance(c, PowerSGD)
    c.set_layout(0, BucketLayout.of_shapes(SHAPES, prefix="b0."))
    key = c._state_key(0)
    c.reduce_(comm, torch.randn(numel), bucket=0, step=0)
    failures = []
    if set(c.qs) != {key} or set(c.feedback.residuals) != {key}:
        failures.append(f"no state after a step: {sorted(c.qs)}")
    c.set_layout(0, BucketLayout.of_shapes(list(SHAPES), prefix="b0."))  # the same layout again
    if set(c.qs) != {key}:
        failures.append("re-setting the same layout dropped the state")
    # A new layout whose one tensor has the first one's name but another shape: that tensor's
    # old residual and factor mean nothing for it (dropped and counted), the bucket starts anew.
    c.set_layout(0, BucketLayout.of_shapes([torch.Size([numel])], prefix="b0."))
    if c._state_key(0) in c.qs or c._state_key(0) in c.feedback.residuals:
        failures.append("a changed layout took over state of another shape")
    dropped = SHAPES[0].numel() + SHAPES[0][1] * 2  # its residual and its Q (cols x rank)
    if c.state_moves.dropped_numel != dropped or c.state_moves.moved_numel != 0:
        failures.append(f"state moves {c.state_moves}, expected {dropped} dropped")
    try:
        c.reduce_(comm, torch.randn(numel + 1), bucket=0, step=1)
        failures.append("a bucket that does not match its layout was accepted")
    except ValueError as err:
        if f"bucket 0 has {numel + 1} elements but its layout (1 tensors) holds {numel}" not in str(
            err
        ):
            failures.append(str(err))
    return failures


def test_layout_change_drops_state_of_another_shape_and_mismatch_is_an_error(pool: Any) -> None:
    for failures in pool(2).run(layout_changes, NUMEL, timeout_s=60):
        assert failures == []


def alternating_recovery(shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """ACP-SGD rank 4 on the same rank-2-per-rank gradient twice: the first step (P sent,
    random Q fixed) projects onto a random subspace; the second (Q sent, P = span of the first
    step's M Q fixed) holds the whole column space, so with error feedback the two outputs add
    up to twice the true average. One allreduce per step."""
    comm = Communicator()
    gen = torch.Generator().manual_seed(comm.rank)
    grad = torch.cat(
        [(torch.randn(s[0], 2, generator=gen) @ torch.randn(2, s[1], generator=gen)).view(-1)
         for s in shapes]
    )  # fmt: skip
    want = grad.clone()
    comm.all_reduce(want, "avg")
    c = compressor_from_spec("acpsgd:rank=4,warmup=0", algo="native")
    c.set_layout(0, BucketLayout.of_shapes([torch.Size(s) for s in shapes], prefix="b0."))
    outs, calls = [], []
    for step in range(2):
        comm.stats.reset()
        out = grad.clone()
        c.reduce_(comm, out, bucket=0, step=step)
        outs.append(out)
        calls.append(comm.stats["all_reduce"].calls)
    return {
        "first": float((outs[0] - want).norm() / want.norm()),
        "two steps": float((outs[0] + outs[1] - 2 * want).norm() / want.norm()),
        "calls": calls,
    }


def test_acpsgd_alternation_recovers_low_rank_gradients_over_two_steps(pool: Any) -> None:
    for r in pool(2).run(alternating_recovery, [(48, 32), (32, 48), (20, 40)], timeout_s=60):
        assert r["first"] > 0.05, r  # a random subspace misses part of the gradient...
        assert r["two steps"] < 1e-5, r  # ...which error feedback sends in the next step
        assert r["calls"] == [1, 1], r  # one factor, one round trip per step


def high_rank_warmup(numel: int) -> dict[str, Any]:
    """``warmup_rank``: the warm-up steps go as PowerSGD of that rank (its bytes), and what
    they leave out is in the shared residual when the low-rank steps begin."""
    comm = Communicator()
    c = compressor_from_spec("powersgd:rank=1,warmup=2,warmup_rank=4", algo="native")
    c.set_layout(0, BucketLayout.of_shapes(SHAPES, prefix="b0."))
    high = compressor_from_spec("powersgd:rank=4,warmup=0", algo="native")
    high.set_layout(0, BucketLayout.of_shapes(SHAPES, prefix="b0."))
    sent, claimed = [], []
    for step in range(3):
        comm.stats.reset()
        c.reduce_(comm, torch.randn(numel, generator=torch.Generator().manual_seed(step)),
                  bucket=0, step=step)  # fmt: skip
        sent.append(comm.stats.total().native_bytes)
        claimed.append(c.payload_bytes(numel, torch.float32, 2, step=step, bucket=0))
    return {
        "sent": sent,
        "claimed": claimed,
        "rank 4 bytes": high.payload_bytes(numel, torch.float32, 2, step=0, bucket=0),
        "residual": float(c.feedback.residuals[c._state_key(0)].norm()),
    }


def test_powersgd_warmup_at_a_higher_rank(pool: Any) -> None:
    for r in pool(2).run(high_rank_warmup, NUMEL, timeout_s=60):
        assert r["sent"] == r["claimed"], r
        assert r["sent"][0] == r["sent"][1] == r["rank 4 bytes"] > r["sent"][2], r
        assert r["residual"] > 0, r
    with pytest.raises(ValueError, match="warmup_fp16 or warmup_rank"):
        compressor_from_spec("powersgd:warmup_fp16=1,warmup_rank=8")


def undone_step(spec: str) -> dict[str, Any]:
    """Steps 0, 1, 2 of ``spec``, once straight and once with a step 1 on other gradients
    undone (``snapshot`` before it, ``load_state_dict`` after) and taken again: a
    fault-tolerant step that failed. The two runs must agree bit for bit, and the snapshots
    must not copy the residual (its storage: the live one, two buffers in turn)."""
    comm = Communicator()
    gen = torch.Generator().manual_seed(comm.rank)
    grads = [torch.randn(NUMEL, generator=gen) for _ in range(4)]
    layout = BucketLayout.of_shapes(SHAPES, prefix="b0.")

    def fresh() -> Any:
        c = compressor_from_spec(spec, algo="native")
        c.set_layout(0, layout)
        return c

    def step(c: Any, grad: torch.Tensor, at: int) -> torch.Tensor:
        out = grad.clone()
        c.reduce_(comm, out, bucket=0, step=at)
        return out

    straight = fresh()
    want = [step(straight, grads[at], at) for at in range(3)]
    c = fresh()
    got = [step(c, grads[0], 0)]
    shared, storages = [], set()
    undo = c.snapshot()
    step(c, grads[3], 1)  # the failed attempt
    c.load_state_dict(undo)
    for at in (1, 2):
        undo = c.snapshot()
        residual = c.feedback.residuals[layout.key]
        shared.append(undo["feedback"]["residuals"][layout.key] is residual)
        got.append(step(c, grads[at], at))
        storages.add(c.feedback.residuals[layout.key].data_ptr())
    final, ref = c.state_dict(), straight.state_dict()
    return {
        "outputs equal": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
        "residual equal": torch.equal(
            final["feedback"]["residuals"][layout.key], ref["feedback"]["residuals"][layout.key]
        ),
        "factors equal": all(
            torch.equal(final[k][layout.key], ref[k][layout.key]) for k in ("qs", "ps") if k in ref
        ),
        "shared": shared,
        "storages": len(storages),
    }


@pytest.mark.parametrize(
    "spec", ["powersgd:rank=2,warmup=1,warmup_rank=4", "acpsgd:rank=2,warmup=0"]
)
def test_snapshot_undoes_a_step_without_copying_the_residual(pool: Any, spec: str) -> None:
    for r in pool(2).run(undone_step, spec, timeout_s=60):
        assert r == {
            "outputs equal": True,
            "residual equal": True,
            "factors equal": True,
            "shared": [True, True],
            "storages": 2,
        }

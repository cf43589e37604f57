"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): rank-r factors, allreduced.

A gradient matrix ``M`` (m x c) is approximated by ``P Q^T`` with ``P`` m x r and ``Q`` c x r,
found by one step of power iteration that starts from the previous step's ``Q`` (warm start:
the gradient changes slowly, so one iteration per step tracks its top subspace). Both factors
are sums of the ranks' own factors, so they ride plain allreduces. Per bucket and step:

1. ``M = g + e`` (error feedback), cut into matrices (below);
2. ``P = M Q`` per matrix; ONE allreduce(avg) of every P of the bucket, with the elements that
   are not compressed packed in front of them; orthonormalise each ``P`` (QR, batched over
   matrices of one shape, identical on every rank);
3. ``Q = M^T P``; this rank's own loss is ``e = M - P Q^T`` (the paper's local error: the
   residuals of all ranks plus what was sent add up to the true gradients exactly);
4. ONE allreduce(avg) of every Q; the output is ``P Q^T`` = the average of the ranks'
   ``P P^T M_r``.

Matrices. With a layout (``set_layout(bucket, shapes)``, called by the engine and by
``commfuse.hooks`` with the shapes of the tensors packed into the bucket) each tensor with
``ndim >= 2`` is its own ``(shape[0], numel / shape[0])`` matrix at rank ``min(r, rows, cols)``,
as in torch's ``powerSGD_hook``, and 1-D tensors (biases, norms) and tensors whose factors would
not be smaller travel uncompressed (``lowrank.py``). This is what makes PowerSGD work: a weight
gradient is low-rank, a flat run of unrelated parameters is not: on charlm after 20 steps (5
uncompressed), rank 4, the flat layout ended at loss 2.926, per tensor at 2.664, the same as
torch's hook (2.664; DDP 2.614).
Without a layout, the bucket is laid out as one square-ish ``m x c`` matrix (``c =
ceil(sqrt(d))``, ``m = ceil(d/c)``, zero-padded), about ``2 r sqrt(d)`` elements per rank: fewer
bytes than per tensor, much worse approximation.

A bucket (or, with a layout, a tensor) whose factors are not smaller than itself is sent
uncompressed (torch's ``min_compression_rate`` = 1), and so is every bucket during the first
``warmup`` steps (torch's ``start_powerSGD_iter``): early gradients change too fast for a
warm-started low rank to follow. ``warmup_fp16`` sends those steps in fp16: on a slow link they
are the most expensive of the run (on charlm at 100 Mbit/s about 1.9 s each in fp32 against
0.35 s for a compressed step; torch's hook needs at least 2 of them). ``warmup_rank=R`` sends
them as rank-R PowerSGD instead, sharing this compressor's residuals, so what the warm-up leaves
out is sent by the steps after it: on charlm, rank 4 after 2 warm-up steps at rank 32 had the
loss of the fp16 warm-up at step 30 (2.5479 vs 2.5480; DDP 2.4773) for 2.3 MB instead of 6.45
MB per warm-up step (0.57 s against 1.1 s in fp16 and 1.9 s in fp32 at 100 Mbit/s). Warm-up 0
is no substitute: 2.591 at step 30.

``wire="bf16"`` (or ``"fp16"``) sends the factors in 16 bits: half the bytes, so rank 8 costs
what rank 4 costs in fp32. Factors are orthonormal bases and their projections, well scaled, so
8 significant bits lose little next to the rank-r truncation itself: on charlm at step 30,
rank 8 ended at 2.515 with bf16 factors and 2.519 in fp32 (rank 4: 2.545 and 2.548).

Tuning (as in torch's docs): raise ``rank`` until accuracy matches the uncompressed run
(1-4 is often enough); ``warmup`` of about 10% of training. Q starts from a normal draw
seeded by (seed, bucket), the same on all ranks. Factors are computed in fp32 for 16-bit
buckets (CPU QR needs it); their plain elements then travel in fp32 too, packed with the P's.
State per bucket: the Q message (every matrix's Q, flat) and the residual; a bucket whose layout
changes restarts both (they belong to other tensors).

Speed (charlm, 3.2M parameters in 2 buckets, 4 emulated hosts at 100 Mbit/s, shared 2-core
machine). The bytes are torch's to the byte (0.334 MB per step), so the step time is the
collectives' latency plus local work, and local work was the difference: ``isfinite(x).all()``
on every bucket cost 15 ms per 3M elements (now one sum, ``base.all_finite``), and
bucket-sized temporaries cost page faults (M is built in the gradient buffer, the residual in
the old residual's storage). What is left is about 13 ms per step on one core, mostly the
three products per matrix that torch's hook also does (``M Q``, ``M^T P``, ``M - P Q^T``) and
the output ``P Q^T``. Paired step by step against torch's hook, both inside torch DDP, this
compressor's hook takes 0.98-0.99x its time. Not done, measured as not worth it: Gram-Schmidt
(QR is under 1 ms per step here), torch's orthogonalisation of Q before ``P = M Q`` (the span of
``M Q`` does not depend on it), and native instead of ``algo="auto"`` for the small factor
messages (the tuner's recursive doubling and Rabenseifner beat gloo below 64 KB: 3.0 vs 5.6 ms
at 1 KB, 4.7 vs 5.6 ms at 16 KB; natively above).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.compress.base import GradientCompressor, all_finite, generator_for
from commfuse.compress.cast import FP16Compressor
from commfuse.compress.lowrank import Plan, check_shapes, plan_for
from commfuse.compress.wire import divided_into, element_bytes


def matrix_shape(numel: int) -> tuple[int, int]:
    """The square-ish ``(m, c)`` a flat bucket of ``numel`` elements is laid out as."""
    cols = max(1, math.isqrt(numel - 1) + 1) if numel else 1
    return -(-numel // cols), cols


#: ``PowerSGDCompressor.wire`` names and their dtypes.
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (a matrix or a batch of them; reduced Householder
    QR, deterministic on identical inputs). QR, not torch's Gram-Schmidt for r <= 2: a zero
    column (a parameter with no gradient) stays finite instead of dividing by its zero norm."""
    q: torch.Tensor = torch.linalg.qr(p, mode="reduced").Q
    return q


@dataclasses.dataclass(kw_only=True)
class PowerSGDCompressor(GradientCompressor):
    """Rank-``rank`` power iteration with warm start and error feedback."""

    name: ClassVar[str] = "powersgd"
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]] = "all_reduce"
    #: A non-finite M reaches every rank through P (or the plain elements) in the first
    #: allreduce, and Q and the residual are only written when that message is finite.
    nonfinite_reaches_every_rank: ClassVar[bool] = True
    rank: int = 2
    """Rank ``r`` of the approximation."""
    warmup: int = 10
    """Steps sent uncompressed before compression starts."""
    warmup_fp16: bool = False
    """Send the warm-up steps in fp16 (half the bytes of torch's fp32 warm-up; pre-divided by
    the world size, so the sum overflows only where the average would)."""
    warmup_rank: int = 0
    """Send the warm-up steps as PowerSGD of this (higher) rank instead of uncompressed (0:
    uncompressed, or fp16 with ``warmup_fp16``); its residual carries into the steps after."""
    wire: str = "fp32"
    """The factors' (and plain elements') type on the wire: ``fp32``, or ``bf16`` / ``fp16`` for
    half the bytes (the maths stays in fp32; a message is divided by the world size, rounded,
    summed, and widened back, the same on every rank). The rounding is not error-fed back."""
    ef: bool = True
    qs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, init=False, repr=False)
    plans: dict[int, Plan] = dataclasses.field(default_factory=dict, init=False, repr=False)
    warmup_compressor: GradientCompressor | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    """What sends the warm-up steps when they are not plain fp32: fp16 (no error feedback) with
    ``warmup_fp16``, rank-``warmup_rank`` PowerSGD sharing this one's residuals."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"powersgd: rank must be >= 1, got {self.rank}")
        if self.warmup < 0:
            raise ValueError(f"powersgd: warmup must be >= 0 steps, got {self.warmup}")
        if self.warmup_rank < 0:
            raise ValueError(f"powersgd: warmup_rank must be >= 0, got {self.warmup_rank}")
        if self.wire not in WIRE_DTYPES:
            raise ValueError(
                f"powersgd: wire must be one of {', '.join(WIRE_DTYPES)}, got {self.wire!r}"
            )
        if self.warmup_fp16 and self.warmup_rank:
            raise ValueError("powersgd: give warmup_fp16 or warmup_rank, not both")
        if self.warmup_fp16:
            self.warmup_compressor = FP16Compressor(algo=self.algo)
        elif self.warmup_rank:
            lowrank = PowerSGDCompressor(
                algo=self.algo,
                rank=self.warmup_rank,
                warmup=0,
                ef=self.ef,
                seed=self.seed,
                wire=self.wire,
            )
            lowrank.feedback = self.feedback  # what the warm-up leaves out is sent later
            self.warmup_compressor = lowrank

    def _warmup_compressor_at(self, step: int | None) -> GradientCompressor | None:
        """What sends a warm-up step that is not plain fp32 (None after the warm-up)."""
        if self.warmup_compressor is not None and step is not None and step < self.warmup:
            return self.warmup_compressor
        return None

    # -- layout -----------------------------------------------------------------------------------
    def set_layout(self, bucket: int, shapes: Sequence[torch.Size]) -> None:
        """Compress bucket ``bucket`` tensor by tensor (see the module docstring). A changed
        layout drops the bucket's Q and residual; the same one again is free (the hook calls
        this for every bucket of every step)."""
        checked = check_shapes(shapes)
        if self.warmup_compressor is not None:
            self.warmup_compressor.set_layout(bucket, checked)
        old = self.plans.get(bucket)
        if old is not None and old.shapes == checked:
            return
        if old is not None:
            self.qs.pop(bucket, None)
            self.feedback.residuals.pop(bucket, None)
        self.plans[bucket] = plan_for(checked, self.rank)

    def _plan(self, bucket: int | None, numel: int) -> Plan | None:
        plan = self.plans.get(bucket) if bucket is not None else None
        if plan is not None and plan.numel != numel:
            raise ValueError(
                f"powersgd: bucket {bucket} has {numel} elements but its layout "
                f"({len(plan.shapes)} tensors) holds {plan.numel}"
            )
        return plan

    # -- sizes ------------------------------------------------------------------------------------
    def compresses(self, numel: int, step: int | None, *, bucket: int | None = None) -> bool:
        """Whether a bucket of ``numel`` elements is sent as factors at ``step``."""
        if step is not None and step < self.warmup:
            return False
        plan = self._plan(bucket, numel)
        if plan is not None:
            return bool(plan.groups)
        m, c = matrix_shape(numel)
        return (m + c) * self.rank < numel

    def payload_bytes(
        self,
        numel: int,
        dtype: torch.dtype,
        world_size: int,
        *,
        step: int | None = None,
        bucket: int | None = None,
    ) -> int:
        """As the base's; with ``bucket``, that bucket's layout (if one was set) decides: plain
        elements + P's + Q's per tensor. Without, the flat layout's ``(m + c) r``."""
        if not self.compresses(numel, step, bucket=bucket):
            warm = self._warmup_compressor_at(step)
            if warm is not None:
                return warm.payload_bytes(numel, dtype, world_size, bucket=bucket)
            return numel * element_bytes(dtype)
        plan = self._plan(bucket, numel)
        if plan is not None:
            return plan.message_numel() * self._wire_bytes(dtype)
        m, c = matrix_shape(numel)
        return (m + c) * self.rank * self._wire_bytes(dtype)

    def _wire_dtype(self, factors: torch.dtype) -> torch.dtype:
        """The type factors computed in ``factors`` travel in (``wire`` narrows fp32 only)."""
        return WIRE_DTYPES[self.wire] if factors == torch.float32 else factors

    def _wire_bytes(self, dtype: torch.dtype) -> int:
        """Bytes per factor element on the wire for gradients of ``dtype``."""
        return element_bytes(self._wire_dtype(factor_dtype(dtype)))

    @property
    def certifies_output(self) -> bool:
        """The output is ``P F^T`` with ``P`` orthonormal (entries at most 1) and ``F`` a
        received factor: finite when every message was and ``r |F|`` stays in range."""
        return True

    def _certify(self, finite: bool, factor: torch.Tensor, grad_dtype: torch.dtype) -> bool | None:
        """``output_finite`` for an output ``B factor^T`` with ``B`` orthonormal: False when a
        received message was not finite, True when ``2 r max|factor|`` fits ``grad_dtype``
        (2: a margin for rounding), None (check the output) for 16-bit gradients, whose plain
        elements narrow from fp32 on the way out."""
        if not finite:
            return False
        if grad_dtype not in (torch.float32, torch.float64):
            return None
        limit = torch.finfo(grad_dtype).max / (2 * self.rank)
        return factor.numel() == 0 or bool(factor.abs().max() < limit) or None

    def _average(self, comm: Communicator, message: torch.Tensor) -> None:
        """Average the factors ``message`` over the ranks in place, in the ``wire`` type."""
        wire = self._wire_dtype(message.dtype)
        if wire == message.dtype:
            C.all_reduce(comm, message, "avg", algo=self.algo)
            return
        on_wire = divided_into(message, comm.world_size, wire)  # pre-divided: see divided_into
        C.all_reduce(comm, on_wire, "sum", algo=self.algo)
        message.copy_(on_wire)

    def initial_q(self, cols: int, dtype: torch.dtype, bucket: int) -> torch.Tensor:
        """The first Q of a bucket: a normal draw, the same on every rank (``cols x rank``;
        with a layout, ``cols`` = every matrix's Q elements / rank)."""
        return torch.randn(cols, self.rank, generator=generator_for(self.seed, bucket)).to(dtype)

    # -- reduce -----------------------------------------------------------------------------------
    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        numel = grad.numel()
        if not self.compresses(numel, step, bucket=bucket):
            warm = self._warmup_compressor_at(step)
            if warm is not None:
                warm._reduce(comm, grad, bucket=bucket, step=step, commit=commit)
            else:
                C.all_reduce(comm, grad, "avg", algo=self.algo)
            return
        plan = self._plan(bucket, numel)
        if plan is None:
            self._reduce_flat(comm, grad, bucket=bucket, commit=commit)
        else:
            self._reduce_by_tensor(comm, grad, plan, bucket=bucket, commit=commit)

    def _reduce_by_tensor(
        self, comm: Communicator, grad: torch.Tensor, plan: Plan, *, bucket: int, commit: bool
    ) -> None:
        """Steps 1-4 of the module docstring, one matrix per tensor, two allreduces."""
        dtype = factor_dtype(grad.dtype)
        # M = g + e in grad itself: grad is overwritten by the output only after the last read
        # of M, and the old residual's storage takes the new one (no bucket-sized allocation:
        # each costs page faults, ~1.5 ms per 12 MB here).
        old = self.feedback.add_to_(bucket, grad) if self.ef else None
        xf = grad if grad.dtype == dtype else grad.to(dtype)
        q_all = self.qs.get(bucket)
        if q_all is None or q_all.shape != (plan.q_numel,) or q_all.dtype != dtype:
            gen = generator_for(self.seed, bucket)
            q_all = torch.randn(plan.q_numel, generator=gen).to(dtype)
        # Message 1: [plain elements | P of every matrix]; P = M Q written straight into it.
        first = torch.empty(plan.plain_numel + plan.p_numel, dtype=dtype)
        plan.pack_plain(xf, first)
        p_all = first[plan.plain_numel :]
        blocks = []  # per group: (matrices, P block, Q block)
        for g in plan.groups:
            k = len(g.members)
            mats = [
                xf[m.offset : m.offset + g.rows * g.cols].view(g.rows, g.cols) for m in g.members
            ]
            ps = p_all[g.p_offset : g.p_offset + g.p_numel].view(k, g.rows, g.rank)
            qs = q_all[g.q_offset : g.q_offset + g.q_numel].view(k, g.cols, g.rank)
            for mat, p, q in zip(mats, ps, qs, strict=True):
                torch.mm(mat, q, out=p)
            blocks.append((mats, ps))
        self._average(comm, first)
        # Another rank's non-finite gradient reaches everyone through P: keep Q and e clean.
        first_finite = all_finite(first)
        commit = commit and first_finite
        # Message 2: Q = M^T P per matrix, with P orthonormalised one batched QR per shape.
        q_new = torch.empty(plan.q_numel, dtype=dtype)
        residual = None
        if self.ef and commit:  # only a finite step may touch the state
            residual = old if old is not None and old.dtype == dtype else torch.empty_like(xf)
            plan.zero_plain(residual)  # sent exactly: nothing left over
        for g, (mats, ps) in zip(plan.groups, blocks, strict=True):
            ps.copy_(orthonormalize(ps))
            qs = q_new[g.q_offset : g.q_offset + g.q_numel].view(len(mats), g.cols, g.rank)
            for m, mat, p, q in zip(g.members, mats, ps, qs, strict=True):
                torch.mm(mat.T, p, out=q)
                if residual is not None:  # e = M - P Q_own^T
                    e = residual[m.offset : m.offset + g.rows * g.cols].view(g.rows, g.cols)
                    torch.addmm(mat, p, q.T, alpha=-1, out=e)
        if residual is not None:
            self.feedback.update(bucket, residual.to(grad.dtype))
        self._average(comm, q_new)
        q_finite = all_finite(q_new)
        if commit and q_finite:
            self.qs[bucket] = q_new  # warm start of the next step (a fresh tensor, not shared)
        self.output_finite = self._certify(first_finite and q_finite, q_new, grad.dtype)
        # Output: the averaged plain elements and P Q^T per matrix, in place.
        out = grad if grad.dtype == dtype else torch.empty(plan.numel, dtype=dtype)
        plan.unpack_plain(first, out)
        for g, (_, ps) in zip(plan.groups, blocks, strict=True):
            qs = q_new[g.q_offset : g.q_offset + g.q_numel].view(len(ps), g.cols, g.rank)
            for m, p, q in zip(g.members, ps, qs, strict=True):
                view = out[m.offset : m.offset + g.rows * g.cols].view(g.rows, g.cols)
                torch.mm(p, q.T, out=view)
        if out is not grad:
            grad.copy_(out)

    def _reduce_flat(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, commit: bool
    ) -> None:
        numel = grad.numel()
        m, c = matrix_shape(numel)
        dtype = factor_dtype(grad.dtype)
        x = self.feedback.corrected(bucket, grad) if self.ef else grad
        matrix = torch.zeros(m * c, dtype=dtype)
        matrix[:numel] = x
        matrix = matrix.view(m, c)
        q = self.qs.get(bucket)
        if q is None or q.shape != (c, self.rank) or q.dtype != dtype:
            q = self.initial_q(c, dtype, bucket)
        p = matrix @ q
        self._average(comm, p)
        # Another rank's non-finite gradient reaches everyone through P: keep Q and e clean.
        p_finite = all_finite(p)
        commit = commit and p_finite
        p = orthonormalize(p)
        q = matrix.T @ p
        if self.ef and commit:
            own = (p @ q.T).view(-1)[:numel]
            self.feedback.update(bucket, x - own.to(grad.dtype))
        q = q.contiguous()
        self._average(comm, q)
        q_finite = all_finite(q)
        if commit and q_finite:
            self.qs[bucket] = q.clone()  # warm start of the next step
        self.output_finite = self._certify(p_finite and q_finite, q, grad.dtype)
        grad.copy_((p @ q.T).view(-1)[:numel])

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "qs": {b: q.clone() for b, q in self.qs.items()}}
        if isinstance(self.warmup_compressor, PowerSGDCompressor):  # residuals are shared
            state["warmup_qs"] = {b: q.clone() for b, q in self.warmup_compressor.qs.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.qs = {int(b): q.clone() for b, q in state["qs"].items()}
        if isinstance(self.warmup_compressor, PowerSGDCompressor):
            warm = state.get("warmup_qs", {})
            self.warmup_compressor.qs = {int(b): q.clone() for b, q in warm.items()}

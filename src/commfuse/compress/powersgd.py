"""PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019): rank-r factors, allreduced.

A gradient matrix ``M`` (m x c) is approximated by ``P Q^T`` (P m x r, Q c x r) from one step
of power iteration warm-started at the last step's Q: the gradient changes slowly, so one
iteration per step tracks its top subspace. Per bucket and step (the paper's Algorithm 1):

1. ``M = g + e`` (error feedback), cut into matrices (below);
2. ``P = M Q`` per matrix; ONE allreduce(avg) of every P, with the elements sent uncompressed
   packed in front; orthonormalise each P (QR batched per shape, identical on every rank);
3. ``Q = M^T P``; this rank keeps ``e = M - P Q^T`` of its own Q (``error_memory="local"``)
   or, after step 4, of the averaged one (``"averaged"``, torch's ``powerSGD_hook``);
4. ONE allreduce(avg) of every Q; the output is ``P Q^T``.

With a layout (``set_layout``, from the engine and ``commfuse.hooks``) each tensor with
``ndim >= 2`` is its own ``(shape[0], numel / shape[0])`` matrix at rank ``min(r, rows, cols)``
and the rest travel exactly (``lowrank.py``), as in torch's hook; without one, the bucket is one
zero-padded square-ish matrix. The first ``warmup`` steps go uncompressed (torch's
``start_powerSGD_iter``), or in fp16 (``warmup_fp16``), or at a higher rank sharing the
residuals (``warmup_rank``); ``wire="bf16"`` sends the factors in 16 bits. Factors are computed
in fp32 for 16-bit buckets; Q starts from a normal draw seeded by (seed, bucket).

State per bucket: the Q message and the residual, filed under the bucket's layout, which follow
their tensors into new buckets (``layout.py``). Why each piece, the two error memories, what
matching torch's hook takes, costs and tuning: docs/data-parallel.md, "PowerSGD".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

import torch

from commfuse import collectives as C
from commfuse.comm import Communicator
from commfuse.compress.base import Compressor, all_finite, generator_for
from commfuse.compress.cast import FP16
from commfuse.compress.layout import BucketLayout
from commfuse.compress.lowrank import Plan, plan_for
from commfuse.compress.wire import divided_into, element_bytes


def matrix_shape(numel: int) -> tuple[int, int]:
    """The square-ish ``(m, c)`` a flat bucket of ``numel`` elements is laid out as."""
    cols = max(1, math.isqrt(numel - 1) + 1) if numel else 1
    return -(-numel // cols), cols


ErrorMemory = Literal["local", "averaged"]
"""The error each rank feeds back (``PowerSGD.error_memory``)."""

Wire = Literal["fp32", "bf16", "fp16"]
"""The type factors travel in (``PowerSGD.wire``)."""

_WIRE_DTYPES: dict[Wire, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (a matrix or a batch of them; reduced Householder
    QR, deterministic on identical inputs). QR, not torch's Gram-Schmidt for r <= 2: a zero
    column (a parameter with no gradient) stays finite instead of dividing by its zero norm."""
    q: torch.Tensor = torch.linalg.qr(p, mode="reduced").Q
    return q


@dataclasses.dataclass(kw_only=True)
class PowerSGD(Compressor):
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
    wire: Wire = "fp32"
    """The factors' (and plain elements') type on the wire: ``fp32``, or ``bf16`` / ``fp16`` for
    half the bytes (the maths stays in fp32; a message is divided by the world size, rounded,
    summed, and widened back, the same on every rank). The rounding is error-fed back only with
    ``error_memory="averaged"``."""
    ef: bool = True
    error_memory: ErrorMemory = "local"
    """What each rank keeps as its error: ``local``, its own ``M - P Q_own^T`` before the Q's
    are averaged (Algorithm 1 of the paper); ``averaged``, its input minus the averaged output,
    ``M - P Q^T`` (torch's ``powerSGD_hook``; the plain elements then keep ``own - average``
    and the ``wire`` rounding is fed back too). The same outputs up to rounding, different
    shares of the error per rank: docs/data-parallel.md, "Error memory"."""
    orthonormalize_q: bool = False
    """Orthonormalise the warm-start Q before ``P = M Q``, as torch's hook does: the same
    subspace (and output, up to rounding), with P's columns of like length when Q's are not;
    one small batched QR per matrix shape and step."""
    qs: dict[str, torch.Tensor] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """The last averaged Q of each bucket, keyed like the residuals (``layout.py``)."""
    plans: dict[str, Plan] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """The per-tensor plan of each layout seen, by layout key (derived, not state)."""
    warmup_compressor: Compressor | None = dataclasses.field(
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
        if self.wire not in _WIRE_DTYPES:
            raise ValueError(
                f"powersgd: wire must be one of {', '.join(_WIRE_DTYPES)}, got {self.wire!r}"
            )
        if self.error_memory not in ("local", "averaged"):
            raise ValueError(
                f"powersgd: error_memory must be local or averaged, got {self.error_memory!r}"
            )
        if self.warmup_fp16 and self.warmup_rank:
            raise ValueError("powersgd: give warmup_fp16 or warmup_rank, not both")
        if self.warmup_fp16:
            self.warmup_compressor = FP16(algo=self.algo)
        elif self.warmup_rank:
            lowrank = PowerSGD(
                algo=self.algo,
                rank=self.warmup_rank,
                warmup=0,
                ef=self.ef,
                seed=self.seed,
                wire=self.wire,
                error_memory=self.error_memory,
                orthonormalize_q=self.orthonormalize_q,
            )
            # What the warm-up leaves out is sent later: one residual, checkpointed and moved
            # by this compressor, and one count of moved state.
            lowrank.feedback = self.feedback
            lowrank._shares_feedback = True
            lowrank.state_moves = self.state_moves
            self.warmup_compressor = lowrank

    def _warmup_compressor_at(self, step: int | None) -> Compressor | None:
        """What sends a warm-up step that is not plain fp32 (None after the warm-up)."""
        if self.warmup_compressor is not None and step is not None and step < self.warmup:
            return self.warmup_compressor
        return None

    # -- layout -----------------------------------------------------------------------------------
    def set_layout(self, bucket: int, layout: BucketLayout) -> None:
        """Compress bucket ``bucket`` tensor by tensor (see the module docstring)."""
        if self.warmup_compressor is not None:
            self.warmup_compressor.set_layout(bucket, layout)
        super().set_layout(bucket, layout)
        self._plan_of(layout)

    def _plan_of(self, layout: BucketLayout) -> Plan:
        plan = self.plans.get(layout.key)
        if plan is None:
            plan = self.plans[layout.key] = plan_for(layout.shapes, self.rank)
        return plan

    def _plan(self, bucket: int | None, numel: int) -> Plan | None:
        layout = self.layouts.get(bucket) if bucket is not None else None
        if layout is None:
            return None
        plan = self._plan_of(layout)
        if plan.numel != numel:
            raise ValueError(
                f"powersgd: bucket {bucket} has {numel} elements but its layout "
                f"({len(plan.shapes)} tensors) holds {plan.numel}"
            )
        return plan

    # -- state that follows the layout ------------------------------------------------------------
    def _factor_stores(self) -> dict[Literal["p", "q"], dict[str, torch.Tensor]]:
        """The factors kept from step to step, by factor: PowerSGD warm-starts Q only."""
        return {"q": self.qs}

    def _factor_seed(self, factor: Literal["p", "q"], bucket: int) -> tuple[int, ...]:
        """What seeds the draw of ``factor``'s starting value in bucket ``bucket``."""
        del factor  # PowerSGD starts from Q only
        return (self.seed, bucket)

    def _state_stores(self) -> list[dict[str, torch.Tensor]]:
        return [*super()._state_stores(), *self._factor_stores().values()]

    def _move_state(
        self, bucket: int, layout: BucketLayout, sources: dict[str, BucketLayout]
    ) -> None:
        super()._move_state(bucket, layout, sources)
        for factor, store in self._factor_stores().items():
            self._move_factors(store, factor, bucket, layout, sources)

    def _initial_factor(
        self,
        factor: Literal["p", "q"],
        plan: Plan,
        dtype: torch.dtype,
        bucket: int,
        device: torch.device,
    ) -> torch.Tensor:
        """The factor a bucket starts from: a normal draw, the same on every rank (on the CPU
        generator, so every device draws the same numbers)."""
        numel = plan.q_numel if factor == "q" else plan.p_numel
        gen = generator_for(*self._factor_seed(factor, bucket))
        return torch.randn(numel, generator=gen, device="cpu").to(device=device, dtype=dtype)

    def _move_factors(
        self,
        store: dict[str, torch.Tensor],
        factor: Literal["p", "q"],
        bucket: int,
        layout: BucketLayout,
        sources: dict[str, BucketLayout],
    ) -> None:
        """Build ``store[layout.key]`` matrix by matrix from each tensor's factor where it
        lives now; matrices without one start as a fresh bucket would. A factor whose matrix
        changed shape or rank is dropped and counted."""
        plan = self._plan_of(layout)
        targets = plan.factor_slices(factor)
        pieces = []
        for index, name in enumerate(layout.names):
            source = sources.get(name)
            old = store.get(source.key) if source is not None else None
            if source is None or old is None:
                continue
            source_plan = self._plan_of(source)
            found = source_plan.factor_slices(factor).get(source.names.index(name))
            if found is None:
                continue  # sent exactly there: no factor to move
            target = targets.get(index)
            total = source_plan.p_numel if factor == "p" else source_plan.q_numel
            same = target is not None and (target[2].rows, target[2].cols, target[2].rank) == (
                found[2].rows,
                found[2].cols,
                found[2].rank,
            )
            if target is None or not same or old.numel() != total:
                self.state_moves.dropped_numel += found[1]
                continue
            pieces.append((target[0], old[found[0] : found[0] + found[1]]))
        if not pieces:
            return
        like = pieces[0][1]
        new = self._initial_factor(factor, plan, like.dtype, bucket, like.device)
        for start, piece in pieces:
            new[start : start + piece.numel()] = piece
            self.state_moves.moved_numel += piece.numel()
        store[layout.key] = new

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

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        """As the base's; with ``bucket``, that bucket's layout (if one was set) decides: plain
        elements + P's + Q's per tensor. Without, the flat layout's ``(m + c) r``."""
        if not self.compresses(numel, step, bucket=bucket):
            warm = self._warmup_compressor_at(step)
            if warm is not None:
                return warm._payload_bytes(numel, dtype, step=None, bucket=bucket)
            return numel * element_bytes(dtype)
        plan = self._plan(bucket, numel)
        if plan is not None:
            return plan.message_numel() * self._wire_bytes(dtype)
        m, c = matrix_shape(numel)
        return (m + c) * self.rank * self._wire_bytes(dtype)

    def _wire_dtype(self, factors: torch.dtype) -> torch.dtype:
        """The type factors computed in ``factors`` travel in (``wire`` narrows fp32 only)."""
        return _WIRE_DTYPES[self.wire] if factors == torch.float32 else factors

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

    def initial_q(
        self, cols: int, dtype: torch.dtype, bucket: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The first Q of a bucket: a normal draw, the same on every rank (``cols x rank``;
        with a layout, ``cols`` = every matrix's Q elements / rank)."""
        gen = generator_for(self.seed, bucket)
        return torch.randn(cols, self.rank, generator=gen, device="cpu").to(device, dtype)

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
        local = self.error_memory == "local"
        # M = g + e in grad itself: grad is overwritten by the output only after the last read
        # of M, and the old residual's storage takes the new one (no bucket-sized allocation,
        # which costs page faults on every step).
        key = self._state_key(bucket)
        old = self.feedback.add_to_(key, grad) if self.ef else None
        xf = grad if grad.dtype == dtype else grad.to(dtype)
        q_all = self.qs.get(key)
        if q_all is None or q_all.shape != (plan.q_numel,) or q_all.dtype != dtype:
            q_all = self._initial_factor("q", plan, dtype, bucket, grad.device)
        if self.orthonormalize_q:
            q_all = self._orthonormal_qs(plan, q_all)
        # Message 1: [plain elements | P of every matrix]; P = M Q written straight into it.
        first = torch.empty(plan.plain_numel + plan.p_numel, dtype=dtype, device=grad.device)
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
        q_new = torch.empty(plan.q_numel, dtype=dtype, device=grad.device)
        residual = None
        if self.ef and commit and local:  # only a finite step may touch the state
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
            self.feedback.update(key, residual.to(grad.dtype))
        self._average(comm, q_new)
        q_finite = all_finite(q_new)
        if commit and q_finite:
            self.qs[key] = q_new  # warm start of the next step (a fresh tensor, not shared)
            if self.ef and not local:  # e = M - P Q^T: keep M (still in grad) until the output
                residual = old if old is not None else torch.empty_like(grad)
                residual.copy_(grad)
        self.output_finite = self._certify(first_finite and q_finite, q_new, grad.dtype)
        # Output: the averaged plain elements and P Q^T per matrix, in place.
        out = grad if grad.dtype == dtype else torch.empty_like(grad, dtype=dtype)
        plan.unpack_plain(first, out)
        for g, (_, ps) in zip(plan.groups, blocks, strict=True):
            qs = q_new[g.q_offset : g.q_offset + g.q_numel].view(len(ps), g.cols, g.rank)
            for m, p, q in zip(g.members, ps, qs, strict=True):
                view = out[m.offset : m.offset + g.rows * g.cols].view(g.rows, g.cols)
                torch.mm(p, q.T, out=view)
        if out is not grad:
            grad.copy_(out)
        if residual is not None and not local:
            self.feedback.update(key, residual.sub_(grad))

    def _orthonormal_qs(self, plan: Plan, q_all: torch.Tensor) -> torch.Tensor:
        """Every matrix's Q orthonormalised (``orthonormalize_q``), as a new tensor: the stored
        Q is never written in place (``snapshot``)."""
        out = torch.empty_like(q_all)
        for g in plan.groups:
            shape = (len(g.members), g.cols, g.rank)
            block = q_all[g.q_offset : g.q_offset + g.q_numel].view(shape)
            out[g.q_offset : g.q_offset + g.q_numel].view(shape).copy_(orthonormalize(block))
        return out

    def _reduce_flat(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, commit: bool
    ) -> None:
        numel = grad.numel()
        m, c = matrix_shape(numel)
        dtype = factor_dtype(grad.dtype)
        local = self.error_memory == "local"
        key = self._state_key(bucket)
        x = self.feedback.corrected(key, grad) if self.ef else grad
        matrix = torch.zeros(m * c, dtype=dtype, device=grad.device)
        matrix[:numel] = x
        matrix = matrix.view(m, c)
        q = self.qs.get(key)
        if q is None or q.shape != (c, self.rank) or q.dtype != dtype:
            q = self.initial_q(c, dtype, bucket, grad.device)
        if self.orthonormalize_q:
            q = orthonormalize(q)
        p = matrix @ q
        self._average(comm, p)
        # Another rank's non-finite gradient reaches everyone through P: keep Q and e clean.
        p_finite = all_finite(p)
        commit = commit and p_finite
        p = orthonormalize(p)
        q = matrix.T @ p
        if self.ef and commit and local:
            own = (p @ q.T).view(-1)[:numel]
            self.feedback.update(key, x - own.to(grad.dtype))
        q = q.contiguous()
        self._average(comm, q)
        q_finite = all_finite(q)
        if commit and q_finite:
            self.qs[key] = q.clone()  # warm start of the next step
        self.output_finite = self._certify(p_finite and q_finite, q, grad.dtype)
        grad.copy_((p @ q.T).view(-1)[:numel])
        if self.ef and commit and q_finite and not local:  # e = M - P Q^T
            self.feedback.update(key, x - grad)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "qs": {b: q.clone() for b, q in self.qs.items()}}
        if isinstance(self.warmup_compressor, PowerSGD):  # residuals are shared
            state["warmup_qs"] = {b: q.clone() for b, q in self.warmup_compressor.qs.items()}
        return state

    def snapshot(self) -> dict[str, Any]:
        """``state_dict()`` without a copy: the factors are replaced by fresh tensors at every
        step, never written in place, and the residuals are kept copy-on-write
        (``ErrorFeedback.keep``), so the tensors of this call stay as they are until the next
        one."""
        state: dict[str, Any] = {
            "layouts": {key: layout.to_state() for key, layout in self._known.items()},
            "feedback": {"residuals": self.feedback.keep()},
        }
        for factor, store in self._factor_stores().items():
            state[f"{factor}s"] = dict(store)
        if isinstance(self.warmup_compressor, PowerSGD):
            state["warmup_qs"] = dict(self.warmup_compressor.qs)
        return state

    def _load_stores(self, state: dict[str, Any]) -> None:
        super()._load_stores(state)
        self.qs = {str(b): q.clone() for b, q in state["qs"].items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if isinstance(self.warmup_compressor, PowerSGD):  # its residuals are this one's
            warm = {"layouts": state["layouts"], "qs": state.get("warmup_qs", {})}
            self.warmup_compressor.load_state_dict(warm)

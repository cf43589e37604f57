"""ACP-SGD (Zhang, Zhang, Shi, Chu and Li, "Evaluation and Optimization of Gradient Compression
for Distributed Deep Learning", ICDCS 2023): PowerSGD that sends one factor per step.

PowerSGD (``powersgd.py``) exchanges both factors of ``M ~ P Q^T`` every step, one after the
other: ``P = M Q`` is allreduced, orthonormalised, and only then can ``Q = M^T P`` be computed
and allreduced. Two dependent round trips per bucket, and the second cannot start before the
first has landed. ACP-SGD alternates instead. With ``M = g + e`` (error feedback) per matrix:

* on even compressed steps ``Q`` is held fixed (last step's averaged ``Q``, orthonormalised) and
  ``P = M Q`` is allreduced; the update is ``P_avg Q^T``;
* on odd steps ``P`` is held fixed (last step's averaged ``P``, orthonormalised) and
  ``Q = M^T P`` is allreduced; the update is ``P Q_avg^T``.

Cost per bucket and step: one allreduce of ``plain + sum rows r'`` (P steps) or ``plain + sum
cols r'`` (Q steps) elements, two products per matrix and one batched QR of the fixed factor.
Because each step runs only half an iteration, the subspace follows a fast-changing gradient
more slowly than PowerSGD's full iteration per step; the paper reports parity with PowerSGD's
accuracy on full-length ImageNet and CIFAR training. Tuning: start from twice the PowerSGD
rank that works (the same bytes), with PowerSGD's warm-up; prefer PowerSGD on short runs from
scratch, and ACP-SGD where the second round trip per bucket is what the step waits for.

Design notes: ``docs/data-parallel.md``, "ACP-SGD: why the alternation converges, and what it shares
with PowerSGD".
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import torch

from commfuse.comm import Communicator
from commfuse.compress.base import all_finite
from commfuse.compress.lowrank import Plan, plan_for
from commfuse.compress.powersgd import (
    PowerSGD,
    factor_dtype,
    matrix_shape,
    orthonormalize,
)


@dataclasses.dataclass(kw_only=True)
class ACPSGD(PowerSGD):
    """Alternating PowerSGD: one factor, one allreduce per bucket and step."""

    name: ClassVar[str] = "acpsgd"
    ps: dict[str, torch.Tensor] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """The last averaged P of each bucket, keyed like the residuals (``layout.py``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.error_memory != "local" or self.orthonormalize_q:
            raise ValueError(
                "acpsgd: error_memory and orthonormalize_q are PowerSGD's settings (torch's "
                "hook); ACP-SGD keeps each rank's own error and its factors as they are"
            )

    def sends_p(self, step: int | None) -> bool:
        """Whether a compressed ``step`` sends P (Q held fixed); else it sends Q."""
        return step is None or (step - self.warmup) % 2 == 0

    def _factor_stores(self) -> dict[Literal["p", "q"], dict[str, torch.Tensor]]:
        """Both factors: a P step holds Q fixed, a Q step P, each the last one averaged."""
        return {"q": self.qs, "p": self.ps}

    def _factor_seed(self, factor: Literal["p", "q"], bucket: int) -> tuple[int, ...]:
        """The fixed factor of a bucket's first P step (Q) or Q step (P)."""
        return (self.seed, bucket, 0 if factor == "q" else 1)

    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        """Plain elements + this step's factor (P's on even compressed steps, Q's on odd; the
        larger of the two for ``step=None``), in the factor dtype."""
        if not self.compresses(numel, step, bucket=bucket):
            return super()._payload_bytes(numel, dtype, step=step, bucket=bucket)
        plan = self._plan(bucket, numel) or self._flat_plan(numel)
        factor = plan.p_numel if self.sends_p(step) else plan.q_numel
        if step is None:
            factor = max(plan.p_numel, plan.q_numel)
        return (plan.plain_numel + factor) * self._wire_bytes(dtype)

    def _flat_plan(self, numel: int) -> Plan:
        """A bucket without a layout: one zero-padded, square-ish matrix."""
        m, c = matrix_shape(numel)
        return plan_for([torch.Size([m, c])], self.rank)

    # -- reduce -----------------------------------------------------------------------------------
    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        key = self._state_key(bucket)
        numel = grad.numel()
        if not self.compresses(numel, step, bucket=bucket):
            super()._reduce(comm, grad, bucket=bucket, step=step, commit=commit)  # warm-up
            return
        plan = self._plan(bucket, numel)
        send_p = self.sends_p(step)
        if plan is not None:
            # M = g + e in grad itself; the output overwrites it after M's last read. The new
            # residual goes into the old one's storage, written only once the exchange is
            # known finite everywhere (no bucket-sized allocation per step, as in PowerSGD).
            old = self.feedback.add_to_(key, grad) if self.ef else None
            dtype = factor_dtype(grad.dtype)
            xf = grad if grad.dtype == dtype else grad.to(dtype)
            residual = None
            if self.ef and commit:
                residual = old if old is not None and old.dtype == dtype else torch.empty_like(xf)
            committed = self._exchange(comm, xf, plan, residual, bucket, send_p, commit, grad.dtype)
            if xf is not grad:
                grad.copy_(xf)
            if residual is not None and committed:
                self.feedback.update(key, residual.to(grad.dtype))
            return
        # No layout: the bucket as one zero-padded m x c matrix.
        x = self.feedback.corrected(key, grad) if self.ef else grad
        flat = self._flat_plan(numel)
        dtype = factor_dtype(grad.dtype)
        padded = torch.zeros(flat.numel, dtype=dtype, device=grad.device)
        padded[:numel] = x
        residual = torch.empty_like(padded) if self.ef and commit else None
        committed = self._exchange(comm, padded, flat, residual, bucket, send_p, commit, grad.dtype)
        if residual is not None and committed:
            self.feedback.update(key, residual[:numel].to(grad.dtype))
        grad.copy_(padded[:numel])

    def _exchange(
        self,
        comm: Communicator,
        xf: torch.Tensor,
        plan: Plan,
        residual: torch.Tensor | None,
        bucket: int,
        send_p: bool,
        commit: bool,
        grad_dtype: torch.dtype,
    ) -> bool:
        """One alternating step on the flat ``M`` (``xf``, laid out by ``plan``): the message
        ``[plain | P's]`` or ``[plain | Q's]``, allreduced, and the averaged update written into
        ``xf``. ``residual`` (if given) gets this rank's ``M`` minus its own projection, only
        when the exchange was finite everywhere (it may be the old residual's storage). Returns
        whether the state was committed; sets ``output_finite`` for gradients of
        ``grad_dtype``."""
        dtype = xf.dtype
        fixed_store, sent_store = (self.qs, self.ps) if send_p else (self.ps, self.qs)
        fixed_numel = plan.q_numel if send_p else plan.p_numel
        sent_numel = plan.p_numel if send_p else plan.q_numel
        key = self._state_key(bucket)
        fixed_all = fixed_store.get(key)
        if fixed_all is None or fixed_all.shape != (fixed_numel,) or fixed_all.dtype != dtype:
            fixed_all = self._initial_factor("q" if send_p else "p", plan, dtype, bucket, xf.device)
        message = torch.empty(plan.plain_numel + sent_numel, dtype=dtype, device=xf.device)
        plan.pack_plain(xf, message)
        sent_all = message[plan.plain_numel :]
        blocks = []  # per group: (group, matrices, fixed factors orthonormalised, sent's place)
        for g in plan.groups:
            k = len(g.members)
            fixed_rows, sent_rows = (g.cols, g.rows) if send_p else (g.rows, g.cols)
            fixed_at, sent_at = (g.q_offset, g.p_offset) if send_p else (g.p_offset, g.q_offset)
            mats = [
                xf[m.offset : m.offset + g.rows * g.cols].view(g.rows, g.cols) for m in g.members
            ]
            fixed = orthonormalize(
                fixed_all[fixed_at : fixed_at + k * fixed_rows * g.rank].view(k, fixed_rows, g.rank)
            )
            place = (slice(sent_at, sent_at + k * sent_rows * g.rank), (k, sent_rows, g.rank))
            sent = sent_all[place[0]].view(place[1])
            for mat, f, s in zip(mats, fixed, sent, strict=True):
                torch.mm(mat if send_p else mat.T, f, out=s)  # P = M Q, or Q = M^T P
            blocks.append((g, mats, fixed, place))
        own = sent_all.clone() if residual is not None else None  # the average overwrites it
        self._average(comm, message)
        # A non-finite M anywhere reaches every rank here: then no state changes on any rank.
        received_finite = all_finite(message)
        # The output multiplies the averaged factor by the orthonormal fixed one.
        self.output_finite = self._certify(received_finite, sent_all, grad_dtype)
        committed = commit and received_finite
        if residual is not None and own is not None and committed:
            plan.zero_plain(residual)  # sent exactly: nothing left over
            for g, mats, fixed, (span, shape) in blocks:
                for m, mat, f, s in zip(g.members, mats, fixed, own[span].view(shape), strict=True):
                    e = residual[m.offset : m.offset + g.rows * g.cols].view(g.rows, g.cols)
                    # e = M - (own P) Q^T, or M - P (own Q)^T: what this rank's message left out
                    p, q = (s, f) if send_p else (f, s)
                    torch.addmm(mat, p, q.T, alpha=-1, out=e)
        plan.unpack_plain(message, xf)
        for _, mats, fixed, (span, shape) in blocks:
            for mat, f, s in zip(mats, fixed, sent_all[span].view(shape), strict=True):
                p, q = (s, f) if send_p else (f, s)
                torch.mm(p, q.T, out=mat)  # the average of the ranks' projections
        if committed:
            sent_store[key] = sent_all.clone()  # the next step holds this factor fixed
        return committed

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ps": {b: p.clone() for b, p in self.ps.items()}}

    def _load_stores(self, state: dict[str, Any]) -> None:
        super()._load_stores(state)
        self.ps = {str(b): p.clone() for b, p in state["ps"].items()}

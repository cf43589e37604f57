"""Compressed stage boundaries: what an activation and its gradient look like on the wire.

Split learning over slow links spends its time sending activations forward and their
gradients back. A ``Boundary`` says how each crosses a stage boundary:

- ``"identity"``: the tensor itself (the default; gradients stay exact).
- ``"fp16"``/``"bf16"``: a cast, 2 bytes an element (the casts of ``commfuse.compress.cast``).
- ``"int8"``: ``q = round(x / scale)`` with ``scale = max|x| / 127`` per row (the last
  dimension: one token's features) or per tensor, one fp32 each, as ``commfuse.compress``'s
  ``Int8``: ``numel + 4 * rows`` bytes.
- ``delta=True``: AQ-SGD (Wang et al., "Fine-tuning Language Models over Slow Networks using
  Activation Compression with Guarantees", NeurIPS 2022). Both sides of a boundary keep each
  sample's last reconstructed activation ``m(xi)`` (zero at first sight). For sample ``xi``:
    1. the sender quantizes the delta, ``q = Q(a(xi) - m(xi))``, and sends ``q``;
    2. both sides update ``m(xi) <- m(xi) + Q^-1(q)``, bit for bit the same;
    3. the next stage runs on ``m(xi)``.
  What the quantizer drops stays in the next delta (error feedback through the cache): as
  training converges, activations change little between epochs, the deltas shrink, and a
  fixed quantizer's error shrinks with them. Gradients go back quantized directly.
- ``"subspace"``: each row's ``k = rank`` coefficients on a fixed orthonormal basis ``U``
  (``k`` elements instead of the row's ``d``), rebuilt as ``(x U) U^T``: Protocol Models
  (Pluralis, NeurIPS 2025) keep activations in such a subspace, which the projection then
  sends exactly; gradients go back as ``g U``, exact for the projected model.

A boundary is applied at every stage boundary, the ones inside a rank too, so the model
computes the same function wherever its stages are placed; only the boundaries between ranks
send bytes. ``Boundary.qdq`` is the exact reference: a stage's input is ``qdq`` of the
previous stage's output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

WIRES = ("identity", "fp16", "bf16", "int8", "subspace")
SCALES = ("row", "tensor")
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_SCALE_BYTES = 4  # one fp32 per row or per tensor
INT8_MAX = 127  # symmetric codes in [-127, 127], as commfuse.compress's Int8


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How activations and their gradients cross a stage boundary (module docstring).

    Raises:
        ValueError: an unknown wire or scale, a scale on a wire other than int8, or a delta
            on the identity wire (a delta only pays where the wire loses precision).

    Example:
        ```python
        runtime = PipelineRuntime(schedule, mine, comm, loss_fn=mse, boundary=Boundary("int8"))
        aq_sgd = Boundary("int8", delta=True)  # then step(..., sample_ids=ids) on every rank
        ```
    """

    wire: str = "identity"
    """``"identity"``, ``"fp16"``, ``"bf16"`` or ``"int8"``."""
    _: dataclasses.KW_ONLY
    scale: str | None = None
    """int8 only: ``"row"`` (the default: one scale per last-dimension row) or ``"tensor"``."""
    delta: bool = False
    """Send each sample's activation as a quantized delta against its cached one (AQ-SGD);
    the step then needs ``sample_ids`` on every rank."""
    rank: int | None = None
    """subspace only: the dimension ``k`` of the fixed subspace each row is projected on."""
    seed: int = 0
    """subspace only: the seed of its basis, the same on every rank."""

    def __post_init__(self) -> None:
        if self.wire not in WIRES:
            raise ValueError(f"boundary wire {self.wire!r}: choose one of {', '.join(WIRES)}")
        if self.scale is not None and (self.wire != "int8" or self.scale not in SCALES):
            raise ValueError(
                f"boundary scale={self.scale!r} with wire {self.wire!r}: a scale is 'row' or "
                "'tensor' and applies to the int8 wire only"
            )
        if (self.wire == "subspace") != (self.rank is not None) or (self.rank or 1) < 1:
            raise ValueError(
                f"boundary wire {self.wire!r} with rank={self.rank}: the subspace wire needs a "
                "rank >= 1 and no other wire takes one"
            )
        if self.delta and self.wire == "subspace":
            raise ValueError(
                "Boundary('subspace', delta=True): a projection is linear and exact on its "
                "subspace, a delta would send the same coefficients; drop delta"
            )
        if self.delta and self.wire == "identity":
            raise ValueError(
                "Boundary('identity', delta=True): a delta only pays on a lossy wire; "
                "choose fp16, bf16 or int8"
            )

    def __str__(self) -> str:
        extra = [f"scale={self.scale}"] if self.scale else []
        extra += [f"rank={self.rank}", f"seed={self.seed}"] if self.rank else []
        return ",".join([self.wire, *extra, *(["delta"] if self.delta else [])])

    @property
    def is_identity(self) -> bool:
        return self.wire == "identity"

    @property
    def per_row(self) -> bool:
        return self.wire == "int8" and self.scale != "tensor"

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The payload's bytes for one tensor of ``shape`` and ``dtype`` (its header aside):
        ``numel * itemsize``, ``numel * 2``, or ``numel + 4 * rows`` (``rows = 1`` per tensor)."""
        numel = math.prod(shape)
        if self.wire == "identity":
            return numel * dtype.itemsize
        if self.wire in _CASTS:
            return numel * 2
        if self.wire == "subspace":
            assert self.rank is not None
            return math.prod(shape[:-1]) * self.rank * dtype.itemsize if shape else 0
        rows = math.prod(shape[:-1]) if self.per_row and len(shape) else 1
        return numel + _SCALE_BYTES * rows

    def encode(self, x: torch.Tensor, *, where: str = "a stage boundary") -> torch.Tensor:
        """The payload of ``x``: ``x`` itself on the identity wire, else ``payload_bytes``
        uint8 (int8: the fp32 scales, then the codes)."""
        if self.is_identity:
            return x
        if not x.is_floating_point():
            raise ValueError(
                f"boundary {self} compresses floating tensors; {where} carries {x.dtype}"
            )
        if self.wire in _CASTS:
            return x.to(_CASTS[self.wire]).reshape(-1).view(torch.uint8)
        if self.wire == "subspace":
            basis = self._basis(x.shape[-1] if x.dim() else 0, x, where)
            return (x.reshape(-1, x.shape[-1]) @ basis).contiguous().view(-1).view(torch.uint8)
        work = _working(x.dtype)
        rows = x.reshape(-1, x.shape[-1]) if self.per_row and x.dim() else x.reshape(1, -1)
        rows = rows.to(work)
        if rows.numel():
            amax = rows.abs().amax(dim=1, keepdim=True)
        else:
            amax = rows.new_zeros(rows.shape[0], 1)
        scale = (amax / INT8_MAX).float()
        codes = torch.round(rows / _safe(scale, work)).clamp_(-INT8_MAX, INT8_MAX)
        return torch.cat(
            [scale.reshape(-1).view(torch.uint8), codes.to(torch.int8).view(-1).view(torch.uint8)]
        )

    def decode(
        self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """The tensor a payload stands for, in ``dtype`` and ``shape``."""
        if self.is_identity:
            return payload
        if self.wire in _CASTS:
            return payload.view(_CASTS[self.wire]).to(dtype).reshape(shape)
        if self.wire == "subspace":
            basis = _basis(shape[-1], int(self.rank or 0), self.seed).to(
                device=payload.device, dtype=dtype
            )
            return (payload.view(dtype).reshape(-1, basis.shape[1]) @ basis.T).reshape(shape)
        numel = math.prod(shape)
        num_scales = (self.payload_bytes(shape, dtype) - numel) // _SCALE_BYTES
        work = _working(dtype)
        scale = payload[: _SCALE_BYTES * num_scales].clone().view(torch.float32).to(work)
        codes = payload[_SCALE_BYTES * num_scales :].view(torch.int8).to(work)
        return (codes.reshape(num_scales, -1) * scale.reshape(-1, 1)).reshape(shape).to(dtype)

    def _basis(self, width: int, x: torch.Tensor, where: str) -> torch.Tensor:
        k = int(self.rank or 0)
        if width < k:
            raise ValueError(
                f"boundary {self} projects rows on {k} dimensions; {where} carries rows of "
                f"{width} features (a {x.dim()}-d tensor)"
            )
        return _basis(width, k, self.seed).to(device=x.device, dtype=x.dtype)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: what the next stage receives for ``x`` without a delta."""
        return self.decode(self.encode(x), x.shape, x.dtype)


@functools.lru_cache(maxsize=64)
def _basis(width: int, k: int, seed: int) -> torch.Tensor:
    """A fixed orthonormal ``width x k`` basis (QR of a seeded Gaussian), the same on every
    rank: ``P = U U^T`` is symmetric, so the gradient going back through ``x -> P x`` is
    ``P g``, sent as ``g U``: the subspace wire's gradients are exact for the projected model."""
    # A seeded CPU draw, the same numbers on every device; callers move it to the activation's.
    gen = torch.Generator().manual_seed(seed)
    draw = torch.randn(width, k, generator=gen, dtype=torch.float64, device="cpu")
    q: torch.Tensor = torch.linalg.qr(draw)[0]
    return q


def _working(dtype: torch.dtype) -> torch.dtype:
    """int8 codes are scaled in fp32 at least (a 16-bit activation's scale may underflow)."""
    return torch.promote_types(dtype, torch.float32)


def _safe(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale in ``dtype``, 1 where it is 0 (an all-zero row's codes are 0 anyway)."""
    s = scale.to(dtype)
    return torch.where(s > 0, s, torch.ones_like(s))


class DeltaCache:
    """One side's AQ-SGD cache: each sample's last reconstructed activation per stage it
    enters (``m(xi)`` of the module docstring). Its state is checkpointed with the runtime."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}

    def gather(self, stage: int, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The cached activations of samples ``ids`` entering ``stage``, zeros for new ones."""
        out = torch.zeros_like(like)
        for i, sample in enumerate(ids.tolist()):
            cached = self.rows.get((stage, sample))
            if cached is None:
                continue
            if cached.shape != like.shape[1:] or cached.dtype != like.dtype:
                raise ValueError(
                    f"sample {sample} enters stage {stage} as {tuple(like.shape[1:])} "
                    f"{like.dtype}; its cached activation is {tuple(cached.shape)} {cached.dtype} "
                    "(a delta boundary needs each sample's activation to keep its shape)"
                )
            out[i] = cached
        return out

    def scatter(self, stage: int, ids: torch.Tensor, values: torch.Tensor) -> None:
        for i, sample in enumerate(ids.tolist()):
            self.rows[(stage, sample)] = values[i].detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return {f"{stage}:{sample}": t.clone() for (stage, sample), t in self.rows.items()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.rows = {}
        for key, t in state.items():
            stage, sample = (int(v) for v in key.split(":"))
            self.rows[(stage, sample)] = t.to(device).clone()

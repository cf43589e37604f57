"""What every compressor is: an in-place, averaged ``reduce_`` of one flat bucket.

A compressor replaces the allreduce of a bucket of gradients (Horovod's
``Compressor.compress/decompress``, torch's DDP communication hooks): every rank encodes its
bucket into a smaller message, the messages are combined with a commfuse collective (an
allreduce when messages can be summed as they are, as with fp16 or PowerSGD's factors; an
allgather when they cannot, as with top-k's values and indices), and each rank decodes the
average. ``Compressor`` declares everything the engine (``commfuse.ddp``) and the DDP hook
(``commfuse.hooks``) ask of one, with defaults:

1. ``aggregation``: the collective that combines the messages;
2. ``set_layout(bucket, layout)`` / ``set_layouts(layouts)``: which parameters a bucket holds
   (``layout.py``); the state of a bucket is filed under its layout, so it follows its
   parameters when buckets change;
3. ``reduce_``: the exchange itself, synchronous, in place;
4. ``payload_bytes``: the exact bytes this rank contributes, for accounting;
5. the finiteness guarantees, ``nonfinite_reaches_every_rank`` and ``certifies_output``
   (below), which let the engine skip an agreement round or a pass over the bucket;
6. ``state_dict`` / ``load_state_dict`` and ``state_moves``: checkpoints and re-layouts;
   ``shared_state_dict`` / ``load_shared_state_dict``: a rank that joins a running job.

Design notes: ``docs/data-parallel.md``, "The Compressor interface: pure parts and non-finite
gradients".
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from commfuse.comm import Communicator
from commfuse.compress.feedback import ErrorFeedback
from commfuse.compress.layout import BucketLayout, StateMoves, anonymous_key, move_elementwise

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterRecipe:
    """The outer step a compressor's paper pairs it with when it compresses a periodic method's
    exchange (``Compressor.outer_recipe``): SparseLoCo's decayed residual is its outer momentum,
    so its paper steps by the plain average (``lr=1.0, momentum=0.0``)."""

    lr: float
    """The outer learning rate."""
    momentum: float
    """The outer SGD's momentum (0: none)."""


def generator_for(*keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded by a stable mix of ``keys`` (seed, step, bucket,
    rank...): the same keys give the same draws on the same kind of device. Draw where the
    numbers are used: a CUDA generator (Philox) draws other numbers than the CPU's (Mersenne
    Twister) from the same seed, but drawing a message's worth on the CPU and copying it to a
    GPU would put the CPU and a copy on every step's path."""
    value = 0x5EED
    for key in keys:
        value = ((value ^ (key & _MASK)) * _MIX + 0x632BE5AB) & _MASK
    return torch.Generator(device=device).manual_seed(value)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, exactly, for the price of one sum.

    ``torch.isfinite(x).all()`` writes and reads back a boolean per element; a sum is one
    fused read. NaN and Inf propagate through a sum (``inf + -inf`` is NaN), so a finite sum
    proves every element finite; a non-finite one is a non-finite element or an overflow of
    large finite ones, and only then is the exact test run. The sum is in the tensor's own
    type (widening a 16-bit tensor to accumulate costs more than the sum): an own-type sum
    that overflows only sends the check down the exact path."""
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


@dataclasses.dataclass(kw_only=True)
class Compressor(abc.ABC):
    """Base of all compressors (see the module docstring). Subclasses are keyword-only
    dataclasses whose init fields are their settings: ``TopK(ratio=0.01)``.

    Equality means the same configuration: two compressors are equal when their settings are,
    whatever state either has built (residuals, momentum, factors, layouts are
    ``compare=False``, and stay out of ``repr``), so a spec round trip or a resumed job's
    config compares equal to the one it came from. Like any mutable dataclass a compressor is
    not hashable."""

    name: ClassVar[str]
    """A short name for messages and reports (``"topk"``, ``"powersgd"``, ...)."""
    aggregation: ClassVar[Literal["all_reduce", "all_gather"]]
    """The collective that combines the ranks' messages."""
    nonfinite_reaches_every_rank: ClassVar[bool] = False
    """Whether one rank's NaN/Inf input makes every rank's output non-finite (it survives the
    sum of the messages) while leaving every rank's state clean. Then ``commfuse.ddp`` needs no
    agreement round before compressing: it checks the output, as it does uncompressed. Not so
    for sign bits, top-k or quantisers with a per-rank scale, which can drop a NaN."""

    outer_recipe: ClassVar[OuterRecipe | None] = None
    """The outer step this compressor's paper uses on a periodic method's exchange, or None
    (the method's own). ``diloco`` takes it for each outer setting its caller leaves unset."""

    own_state: ClassVar[tuple[str, ...]] = ("feedback",)
    """Keys of ``state_dict`` that hold this rank's own accumulators (error-feedback residuals,
    DGC's momentum): its gradient not sent yet, which only the sum over ranks makes whole. A
    rank that joins a running job keeps its own (none after a restart) and is never served
    another's: the sum would count the donor's twice (``shared_state_dict``)."""

    algo: str = "auto"
    """The commfuse allreduce algorithm for allreduce-compatible compressors."""
    gather_algo: str = "auto"
    """The commfuse allgather algorithm for allgather-based compressors."""
    ef: bool = False
    """Error feedback: carry what was not sent into the next step (see ``feedback.py``)."""
    seed: int = 0
    """Seed of the compressor's random choices (mixed with step, bucket and rank)."""

    output_finite: bool | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    """After ``reduce_`` (``certifies_output`` compressors): whether the output is finite on
    every rank, known from the received messages; None = not known, check the output."""
    feedback: ErrorFeedback = dataclasses.field(
        default_factory=ErrorFeedback, init=False, repr=False, compare=False
    )
    layouts: dict[int, BucketLayout] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """The layout each bucket index holds now (``set_layout``)."""
    state_moves: StateMoves = dataclasses.field(
        default_factory=StateMoves, init=False, repr=False, compare=False
    )
    """Elements of state moved to, or dropped from, new bucket layouts so far."""
    _known: dict[str, BucketLayout] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Every layout that holds state or a bucket, by key."""
    _owners: dict[str, str] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Parameter name -> key of the layout whose state holds that parameter's."""
    _shares_feedback: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    """Whether ``feedback`` belongs to another compressor, which then checkpoints and moves it
    (PowerSGD's warm-up compressor shares the residuals of the PowerSGD it warms up)."""

    @property
    def certifies_output(self) -> bool:
        """Whether ``reduce_`` sets ``output_finite`` from the messages it received (PowerSGD's
        family: a finite received factor, within bounds, makes a finite output; fp16/bf16
        without error feedback: the output is the received message), so a caller can skip its
        own passes over the bucket. A local NaN/Inf always reaches those messages, and such a
        compressor keeps its state clean without the caller's ``finite``."""
        return False

    # -- layout and the state that follows it ------------------------------------------------
    def set_layout(self, bucket: int, layout: BucketLayout) -> None:
        """Bucket ``bucket``'s flat buffer holds the tensors of ``layout`` from now on.

        The engine (``commfuse.ddp``) calls it for every bucket whenever it lays the buckets
        out, the DDP hook (``commfuse.hooks``) from each ``GradBucket`` before reducing it. Call
        it with the same layout on every rank, before the bucket's first ``reduce_`` and again
        whenever it changes; the same layout again costs a dictionary lookup. The bucket's
        state is then that layout's; a layout new to this compressor collects its parameters'
        state from wherever they were (``layout.py``). Without a layout a bucket's state is
        keyed by its index, and the caller must keep the same parameters in it."""
        if not isinstance(layout, BucketLayout):
            raise ValueError(
                f"{self.name}: set_layout takes a BucketLayout, got {type(layout).__name__}"
            )
        old = self.layouts.get(bucket)
        if old is not None and old.key == layout.key and self._owns(layout):
            return
        if old is None:
            # State kept by index before a layout was known cannot be told apart by parameter.
            self._forget(anonymous_key(bucket), count=True)
        self.layouts[bucket] = layout
        self._bind(bucket, layout)

    def set_layouts(self, layouts: Sequence[BucketLayout]) -> None:
        """The buckets are exactly these from now on (bucket ``i`` holds ``layouts[i]``): as
        ``set_layout`` for each, and buckets past the end are forgotten, so state that no
        bucket holds any more is freed. The engine calls it whenever it lays buckets out."""
        for bucket in [b for b in self.layouts if b >= len(layouts)]:
            del self.layouts[bucket]
        for bucket, layout in enumerate(layouts):
            self.set_layout(bucket, layout)
        self._collect()

    def _owns(self, layout: BucketLayout) -> bool:
        """Whether ``layout``'s key holds the current state of all its parameters."""
        key = layout.key
        return all(self._owners.get(name) == key for name in layout.names)

    def _state_key(self, bucket: int) -> str:
        """Where bucket ``bucket``'s state is filed: its layout's key, or its index."""
        layout = self.layouts.get(bucket)
        return layout.key if layout is not None else anonymous_key(bucket)

    def _bind(self, bucket: int, layout: BucketLayout) -> None:
        key = layout.key
        self._known[key] = layout
        if not (self._owns(layout) and self._holds_state(key)):
            # No state under this key, or some of it stale (a parameter's state has moved on
            # since): gather each parameter's state from the layout that holds it now, this
            # one included, and drop what the gathering did not replace.
            sources = {
                name: self._known[owner]
                for name in layout.names
                if (owner := self._owners.get(name)) is not None and owner in self._known
            }
            stores = self._state_stores()
            before = [store.get(key) for store in stores]
            if sources:
                self._move_state(bucket, layout, sources)
            for store, stale in zip(stores, before, strict=True):
                if stale is not None and store.get(key) is stale:
                    del store[key]
        for name in layout.names:
            self._owners[name] = key
        self._collect()

    def _collect(self) -> None:
        """Forget every layout that neither a bucket nor any parameter's state points to."""
        bound = {held.key for held in self.layouts.values()}
        owning = set(self._owners.values())
        for stale in [k for k in self._known if k not in bound and k not in owning]:
            del self._known[stale]
            self._forget(stale, count=False)  # everything it held has moved on

    def _state_stores(self) -> list[dict[str, torch.Tensor]]:
        """Every per-bucket state dictionary of this compressor, keyed by state key."""
        return [] if self._shares_feedback else [self.feedback.residuals]

    def _holds_state(self, key: str) -> bool:
        return any(key in store for store in self._state_stores())

    def _forget(self, key: str, *, count: bool) -> None:
        for store in self._state_stores():
            old = store.pop(key, None)
            if old is not None and count:
                self.state_moves.dropped_numel += old.numel()

    def _move_state(
        self, bucket: int, layout: BucketLayout, sources: dict[str, BucketLayout]
    ) -> None:
        """Build ``layout``'s state from its parameters' state in ``sources`` (name -> the
        layout holding it). Element-wise state moves element by element (this default);
        compressors with other state (PowerSGD's factors) move theirs too."""
        if not self._shares_feedback:
            move_elementwise(self.feedback.residuals, layout, sources, self.state_moves)

    # -- the exchange -----------------------------------------------------------------------
    def reduce_(
        self,
        comm: Communicator,
        grad: torch.Tensor,
        *,
        bucket: int,
        step: int,
        finite: bool | None = None,
    ) -> None:
        """Replace the flat 1-D ``grad`` of bucket ``bucket`` IN PLACE by the average over ranks
        of what every rank's compressed message decodes to (error feedback applied).

        Synchronous; every rank calls it for the same buckets in the same order. Run it on the
        communicator's worker thread (``Communicator.submit``) to overlap.
        ``finite``: whether every element of ``grad`` is finite, when the caller has already
        checked (DataParallel has: one pass over the bucket instead of two).

        Raises:
            ValueError: ``grad`` is not a flat floating-point tensor, or not the size of the
                bucket's layout."""
        if grad.dim() != 1 or not grad.is_contiguous():
            raise ValueError(
                f"{self.name}: reduce_ needs a flat, contiguous 1-D bucket, got shape {tuple(grad.shape)}"
            )
        if grad.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{self.name}: gradients must be floating point, got {grad.dtype}")
        layout = self.layouts.get(bucket)
        if layout is not None and layout.numel != grad.numel():
            raise ValueError(
                f"{self.name}: bucket {bucket} has {grad.numel()} elements but its layout "
                f"({len(layout.names)} tensors) holds {layout.numel}"
            )
        if grad.numel() == 0:
            return  # every rank has the same empty bucket: nothing to exchange
        if finite is None:
            finite = all_finite(grad)
        self.output_finite = None
        self._reduce(comm, grad, bucket=bucket, step=step, commit=finite)
        if not finite:
            grad.fill_(float("nan"))

    @abc.abstractmethod
    def _reduce(
        self, comm: Communicator, grad: torch.Tensor, *, bucket: int, step: int, commit: bool
    ) -> None:
        """``reduce_`` on a valid, non-empty bucket; update state only when ``commit``."""

    def payload_bytes(
        self,
        numel: int,
        dtype: torch.dtype,
        world_size: int,
        *,
        step: int | None = None,
        bucket: int | None = None,
    ) -> int:
        """Bytes of the message this rank contributes for a bucket of ``numel`` elements (at
        ``step``; None = after any warm-up). For an allreduce it is the tensor handed to the
        collective, for an allgather this rank's block, summed over the collectives issued.
        ``bucket`` is the index given to ``set_layout``: a compressor whose message depends on
        the bucket's layout (PowerSGD) counts with it; the others ignore it. No commfuse
        message depends on ``world_size`` (it is there for the caller's accounting to read
        alike for every compressor). An empty bucket sends nothing, as ``reduce_`` does.

        Raises:
            ValueError: ``numel`` is negative or ``world_size`` is below 1."""
        if numel < 0 or world_size < 1:
            raise ValueError(
                f"{self.name}: payload_bytes needs numel >= 0 and world_size >= 1, "
                f"got numel={numel}, world_size={world_size}"
            )
        if numel == 0:
            return 0
        return self._payload_bytes(numel, dtype, step=step, bucket=bucket)

    @abc.abstractmethod
    def _payload_bytes(
        self, numel: int, dtype: torch.dtype, *, step: int | None, bucket: int | None
    ) -> int:
        """``payload_bytes`` of a non-empty bucket."""

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything that changes across steps (residuals, momentum, factors) keyed by the
        layout it belongs to, and those layouts: tensors, dicts, lists, strings and numbers
        only, so ``torch.load(weights_only=True)`` reads it."""
        return {
            "layouts": {key: layout.to_state() for key, layout in self._known.items()},
            "feedback": self.feedback.state_dict(),
        }

    def shared_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` without this rank's own accumulators (``own_state``): what a rank
        joining the job is served, the state every rank holds alike (layouts, PowerSGD's
        factors)."""
        state = self.state_dict()
        return {key: value for key, value in state.items() if key not in self.own_state}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``shared_state_dict`` served, keeping this rank's own accumulators (empty
        on a fresh compressor: they start from zero)."""
        own = self.state_dict()
        self.load_state_dict({**state, **{key: own[key] for key in self.own_state}})

    def snapshot(self) -> dict[str, Any]:
        """What ``load_state_dict`` takes to undo the steps reduced after this call (a step
        that failed on some replicas and not others), valid until the next ``snapshot``: this
        default is ``state_dict()``, a copy of every tensor; a compressor whose state is never
        written in place shares its tensors instead (PowerSGD)."""
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``. Buckets laid out already take their state from it,
        moved to their layouts where those differ from the checkpoint's."""
        self._load_stores(state)
        self._load_layouts(state)

    def _load_stores(self, state: dict[str, Any]) -> None:
        """Every per-bucket state dictionary from ``state`` (subclasses add theirs)."""
        if not self._shares_feedback:
            self.feedback.load_state_dict(state["feedback"])

    def _load_layouts(self, state: dict[str, Any]) -> None:
        self._known = {k: BucketLayout.from_state(v) for k, v in state["layouts"].items()}
        self._owners = {name: key for key, layout in self._known.items() for name in layout.names}
        for bucket, layout in self.layouts.items():
            self._bind(bucket, layout)

    # -- helpers --------------------------------------------------------------------------------
    def _check_positive(self, key: str, value: float, *, at_most: float | None = None) -> None:
        if not value > 0 or (at_most is not None and value > at_most):
            bound = f" and <= {at_most:g}" if at_most is not None else ""
            raise ValueError(f"{self.name}: {key} must be > 0{bound}, got {value}")

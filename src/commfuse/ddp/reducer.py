"""Wait-free backprop: each bucket's allreduce starts the moment its last gradient is ready.

The algorithm (Zhang et al., "Poseidon", ATC 2017; Li et al., "PyTorch Distributed", VLDB 2020):

1. Every trainable parameter gets a post-accumulate-grad hook. When it fires, the parameter's
   ``.grad`` is final for this backward: it is copied into its slot of the bucket's flat
   buffer, already multiplied by 1/world (as torch DDP does: the sum of pre-divided gradients is
   the average, with no second pass and no fp16 overflow), and the bucket's count of missing
   gradients drops by one.
2. A bucket whose count reaches zero is launched asynchronously: ``collectives.all_reduce(...,
   async_op=True)``, or the compressor's ``reduce_`` on the communicator's worker thread. The
   collective runs (in gloo, GIL released) while autograd computes the earlier layers.
3. Buckets are launched in bucket order on every rank, whatever order their gradients arrive
   in: if bucket k is complete before bucket k-1 it is held, because ranks must issue
   collectives in the same order or they deadlock.
4. The first hook of a backward queues a callback on autograd's engine (as torch DDP does);
   it runs when backward ends. Parameters that got no gradient in this backward (unused in the
   forward) are handled there: their slot gets their accumulated ``.grad`` (from ``no_sync``
   steps) or zero, so every rank still launches every bucket. Then it waits for the buckets in
   launch order and, as each one lands, checks it for NaN/Inf (``checks.py``: one sum, not a
   boolean per element; none for a compressor that certifies its output from what it
   received) and hands each slot to its parameter as ``.grad`` (the slot itself, as torch
   DDP's ``gradient_as_bucket_view``: no copy; a copy with ``staleness=1``) while later
   buckets are still on the wire; only the last bucket's check is exposed.

Design notes: ``docs/data-parallel.md``, "The reducer: cost, re-layouts, unused parameters,
staleness, non-finite gradients".
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from commfuse.collectives import all_reduce, broadcast
from commfuse.collectives.registry import resolve
from commfuse.comm import Communicator, Handle, OpCounters
from commfuse.compress.base import Compressor, all_finite
from commfuse.compress.layout import BucketLayout
from commfuse.ddp.buckets import Bucket, assign_buckets, build_buckets
from commfuse.ddp.checks import nonfinite_positions, nonfinite_slots
from commfuse.ddp.config import DataParallelConfig
from commfuse.ddp.flight import Flight
from commfuse.ddp.merge import merge_by_cost


class NonFiniteGradientError(RuntimeError):
    """A gradient was NaN or Inf on some rank (``on_nonfinite="raise"``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one synchronized step communicated and waited for, on this rank."""

    step: int
    """The engine's step counter of this step (0-based)."""
    num_buckets: int
    """Buckets reduced."""
    num_collectives: int
    """Collectives the engine launched (buckets, plus flag or used-parameter allreduces)."""
    bytes_sent: int
    """Point-to-point bytes this rank sent (exact; commfuse's own algorithms and compressors)."""
    native_bytes: int
    """Bytes handed to native collectives (their wire traffic depends on the backend)."""
    exposed_comm_s: float
    """Seconds spent at the end of backward waiting for communication (not hidden by compute)."""
    launched_after_grads: tuple[int, ...]
    """Per bucket, how many gradients had arrived when it was launched (overlap evidence)."""
    skipped: bool
    """Whether the step was skipped for a non-finite gradient."""
    gradient_step: int
    """The step whose averaged gradient ``.grad`` now holds: this one, the previous one with
    ``staleness=1``, -1 when none (the first step with ``staleness=1``)."""
    state_moved_numel: int = 0
    """Elements of compressor state moved to their parameters' new buckets so far."""
    state_dropped_numel: int = 0
    """Elements of compressor state that could not follow their parameters so far (dropped,
    never applied to other parameters)."""


def _counters(comm: Communicator) -> OpCounters:
    return comm.stats.total()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements (one is a view of the other's slot)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class Reducer:
    """Buckets, hooks and the end-of-backward synchronisation (see the module docstring)."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        comm: Communicator,
        config: DataParallelConfig,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.comm = comm
        self.config = config
        self.compressor: Compressor | None = config.compressor
        # Pre-divide like torch DDP, except where gradients stay local or the compressor averages.
        plain = self.compressor is None and not config.skip_communication
        self.scale = 1.0 / comm.world_size if plain else 1.0
        launch_order = list(reversed(range(len(self.params))))
        cut = assign_buckets(
            [p.numel() * p.element_size() for p in (self.params[i] for i in launch_order)],
            [self.params[i].dtype for i in launch_order],
            first_cap_bytes=config.first_bucket_cap_bytes,
            cap_bytes=config.bucket_cap_bytes,
        )
        self.set_layout([[launch_order[i] for i in group] for group in cut])
        self.merged = not config.merge_buckets_by_cost
        self.sync = True
        self.step = 0
        self.last_step_skipped = False
        self.update_ready = False
        """Whether ``.grad`` holds an averaged gradient to step with (False with staleness=1
        after the first synchronized step: nothing has landed yet)."""
        self._in_flight: Flight | None = None  # staleness=1: the previous step's reduction
        self.last_stats: StepStats | None = None
        self.used_since_sync = [False] * len(self.params)
        self.awaiting_backward = False
        self.unused_in_forward: list[int] = []
        self._reset_step()
        self._baseline = _counters(comm)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self.params)
        ]

    # -- layout -----------------------------------------------------------------------------------
    def set_layout(self, groups: Sequence[Sequence[int]]) -> None:
        """Use these buckets (lists of parameter indices, in launch order) from now on."""
        flat_members = sorted(i for group in groups for i in group)
        if flat_members != list(range(len(self.params))):
            raise ValueError(
                f"a bucket layout must hold each of the {len(self.params)} trainable parameters once"
            )
        self.groups = [list(group) for group in groups]
        self.buckets: list[Bucket] = build_buckets(self.params, self.groups)
        for bucket in self.buckets:  # between steps: every gradient of the next one to come
            bucket.pending = len(bucket.params)
        if self.compressor is not None:
            # Each bucket's state is filed under its parameters, so it follows them into the new
            # buckets; PowerSGD also compresses each weight matrix on its own from the shapes.
            self.compressor.set_layouts(
                [
                    BucketLayout(
                        names=tuple(self.names[i] for i in bucket.params),
                        shapes=tuple(self.params[i].shape for i in bucket.params),
                    )
                    for bucket in self.buckets
                ]
            )
        self.where = {i: (b.index, slot) for b in self.buckets for slot, i in enumerate(b.params)}
        # staleness=1: the second buffer of each bucket, filled while the first is in flight.
        self._spares = [torch.zeros_like(b.flat) for b in self.buckets if self.config.staleness]
        self.direct = self._all_native()

    @property
    def _agrees_first(self) -> bool:
        """Whether each bucket's job starts with the NaN/Inf agreement allreduce."""
        return self.compressor is not None and not self.compressor.nonfinite_reaches_every_rank

    def _all_native(self) -> bool:
        """Whether every bucket runs gloo/NCCL's own allreduce. Then buckets go straight to the
        backend, not through the worker thread: the backend runs several collectives at once
        (gloo: two threads), where the worker runs one after the other and exposes more of the
        wire time when several buckets are in flight. Mixing the two paths could reorder
        collectives between ranks, so it is all buckets or none."""
        if self.compressor is not None or self.config.skip_communication:
            return False
        if self.comm.world_size == 1:
            return False
        if self.config.algo != "auto":
            return resolve("all_reduce", self.config.algo) == "native"
        from commfuse.collectives import tuner

        return all(
            tuner.choose(self.comm, "all_reduce", b.nbytes) == "native" for b in self.buckets
        )

    def close(self) -> None:
        # staleness=1: the last step's collectives are still running; a rank that left now
        # would cut the others off mid-collective.
        self.land_in_flight()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- during backward --------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self.ready = [False] * len(self.params)
        self.arrival_s = [0.0] * len(self.params)
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._flight = Flight(step=self.step)
        self._num_ready = 0
        self._next_launch = 0
        self._queued = False
        self._t0 = 0.0
        self._marked_unused: set[int] = set()

    def _mark_unused_ready(self) -> None:
        """Fill the slots of the parameters the forward's outputs cannot reach (``graph.py``)
        now, so their buckets launch with their neighbours, not at the end of backward."""
        for index in self.unused_in_forward:
            if not self.ready[index]:
                self.ready[index] = True
                self._marked_unused.add(index)
                self._fill(index, self.params[index].grad)
        self.unused_in_forward = []
        self._launch_ready()

    def reduce_without_backward(self) -> None:
        """Run this step's reduction on a rank whose backward fired no hook (see the module
        docstring): every slot gets the accumulated ``.grad`` or zero."""
        warnings.warn(
            f"rank {self.comm.rank}: no gradient reached DataParallel's parameters after "
            f"synchronized forward of step {self.step} (loss independent of them, or no "
            "backward): reducing zero gradients so the other ranks are not left waiting",
            RuntimeWarning,
            stacklevel=3,
        )
        self._queued = True
        self._t0 = time.perf_counter()
        if self.direct:
            self.comm.drain()
        self._end_of_backward()

    def _hook_for(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return hook

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self.used_since_sync[index] = True
        if not self.sync:
            return  # no_sync: gradients just accumulate in .grad
        if not self._queued:
            self._queued = True
            self._t0 = time.perf_counter()
            if self.direct:
                self.comm.drain()  # the caller's queued collectives go first, on every rank
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._mark_unused_ready()
        if self.ready[index] and index in self._marked_unused:
            raise RuntimeError(
                f"parameter {self.names[index]!r} got a gradient although the forward's outputs do "
                "not depend on it (find_unused_parameters marked it unused when backward began): "
                "return from forward every tensor the loss depends on"
            )
        if self.ready[index]:
            raise RuntimeError(
                f"parameter {self.names[index]!r} got a second gradient in one backward "
                "(reentrant backward or a parameter used by two graphs); DataParallel supports one"
            )
        self.ready[index] = True
        self.arrival_s[index] = time.perf_counter() - self._t0
        self._num_ready += 1
        assert param.grad is not None
        self._fill(index, param.grad)
        self._launch_ready()

    def _fill(self, index: int, grad: torch.Tensor | None) -> None:
        bucket_index, slot = self.where[index]
        bucket = self.buckets[bucket_index]
        target = bucket.view(slot).view(self.params[index].shape)
        with torch.no_grad():
            if grad is None:
                target.zero_()
            elif _same_memory(grad, target):
                # .grad is this slot already (``_copy_back`` left it there, and autograd
                # accumulated into it): nothing to copy.
                if self.scale != 1.0:
                    target.mul_(self.scale)
            elif self.scale == 1.0:
                target.copy_(grad)
            else:
                torch.mul(grad, self.scale, out=target)
        bucket.pending -= 1

    def _launch_ready(self) -> None:
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
        ):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        flight = self._flight
        flight.launched_after.append(self._num_ready)
        if self.config.staleness:
            # The flight keeps the buffer it launched; the next backward fills the other one.
            bucket = dataclasses.replace(bucket)
        flight.buckets.append(bucket)
        handle: Any
        if self.config.skip_communication:
            handle = Handle.completed()
        elif self.compressor is not None:
            name = f"ddp.bucket{bucket.index}"
            handle = self.comm.submit(name, self._compressed_job, bucket, flight)
        elif self.direct:
            handle = self.comm.all_reduce(bucket.flat, "sum", async_op=True)
        else:
            handle = all_reduce(self.comm, bucket.flat, "sum", algo=self.config.algo, async_op=True)
        flight.handles.append(handle)

    def _compressed_job(self, bucket: Bucket, flight: Flight) -> list[tuple[int, int]]:
        """On the worker: agree on finiteness, compress (see the module docstring). Returns the
        (rank, parameter) pairs that were non-finite (rank -1: not known)."""
        assert self.compressor is not None
        if self.compressor.nonfinite_reaches_every_rank:
            return self._compress_then_check(bucket, flight)
        mine = nonfinite_slots(bucket)
        bad = self._agree_nonfinite(mine, bucket)
        if bad:
            flight.poisoned = True
        if flight.poisoned:
            return bad
        self._reduce_compressed(bucket, flight.step, finite=not mine)
        return bad

    def _compress_then_check(self, bucket: Bucket, flight: Flight) -> list[tuple[int, int]]:
        """A compressor whose output turns non-finite on every rank when any input is: no
        agreement round before it (a latency round and a wait for the slowest rank per
        bucket); the output is checked instead, the same on
        every rank, and only then do the ranks name the culprit."""
        if flight.poisoned:  # an earlier bucket of this step was bad: no state may see this one
            return []
        # A compressor that certifies its output from what it received (PowerSGD) needs neither
        # pass over the bucket: its received factors carry any rank's NaN/Inf, and keep its
        # state clean. Two passes over the bucket would cost more CPU than torch's PowerSGD
        # hook spends in all. The culprits, needed only on a bad step, are then found in the
        # parameters' own .grad (the bucket holds the output by then); not with staleness=1,
        # where the next backward may already be writing .grad.
        assert self.compressor is not None
        certified = self.compressor.certifies_output and not self.config.staleness
        mine = None if certified else nonfinite_slots(bucket)  # before the output overwrites it
        self._reduce_compressed(bucket, flight.step, finite=not mine)
        verdict = self.compressor.output_finite if certified else None
        if verdict is None:
            verdict = all_finite(bucket.flat)
        if verdict:
            return []
        flight.poisoned = True
        if mine is None:  # the bucket holds the output now: its parameters' .grad the input
            mine = nonfinite_positions([self.params[index].grad for index in bucket.params])
        # Every rank is here: the output is the same everywhere. No bad input anywhere means
        # the compression itself overflowed (e.g. an fp16 sum past 65504).
        bad = self._agree_nonfinite(mine, bucket)
        return bad or [(-1, index) for index in bucket.params]

    def _agree_nonfinite(self, slots: list[int], bucket: Bucket) -> list[tuple[int, int]]:
        """(rank, parameter) of every non-finite tensor of ``bucket`` on any rank."""
        # One flag per tensor holding rank + 1 where non-finite: after a max, each bad tensor
        # names a rank (the highest bad one) in 4 bytes per tensor at any world size.
        flags = torch.zeros(len(bucket.params), device=bucket.flat.device)
        for slot in slots:
            flags[slot] = float(self.comm.rank + 1)
        all_reduce(self.comm, flags, "max", algo="native")
        return [(int(flags[s]) - 1, bucket.params[int(s)]) for s in flags.nonzero().flatten()]

    def _reduce_compressed(self, bucket: Bucket, step: int, *, finite: bool) -> None:
        """``finite``: this rank's bucket passed ``nonfinite_slots`` (commfuse's compressors then
        skip their own check: one pass over the bucket, not two)."""
        assert self.compressor is not None
        if not self.merged:
            # The MG-WFBP timing step reduces uncompressed: its buckets are about to change, and
            # a compressor's per-bucket state (error feedback) must only ever see final buckets.
            all_reduce(self.comm, bucket.flat, "avg", algo=self.config.algo)
        else:
            self.compressor.reduce_(
                self.comm, bucket.flat, bucket=bucket.index, step=step, finite=finite
            )

    # -- end of backward --------------------------------------------------------------------------
    def _end_of_backward(self) -> None:
        self.awaiting_backward = False
        try:
            self._finish_step()
        finally:
            self.used_since_sync = [False] * len(self.params)
            self.unused_in_forward = []
            self.step += 1
            self._reset_step()

    def _finish_step(self) -> None:
        start = time.perf_counter()
        # Parameters without a gradient in this backward: their accumulated .grad, or zero.
        for index, param in enumerate(self.params):
            if not self.ready[index]:
                self._fill(index, param.grad)
        self._launch_ready()
        used_counts = None
        used_handle: Any = None
        if self.config.find_unused_parameters and not self.config.skip_communication:
            used_counts = torch.tensor(
                self.used_since_sync, dtype=torch.int32, device=self.buckets[0].flat.device
            )
            used_handle = (
                self.comm.all_reduce(used_counts, "sum", async_op=True)
                if self.direct
                else all_reduce(self.comm, used_counts, "sum", algo="native", async_op=True)
            )
        landing: Flight | None = self._flight
        if self.config.staleness:
            # This step's buckets stay in flight through the next step's compute; the previous
            # step's land now. The next backward fills the buffers that just landed.
            landing, self._in_flight = self._in_flight, self._flight
            for bucket in self.buckets:
                bucket.flat, self._spares[bucket.index] = self._spares[bucket.index], bucket.flat
        bad_params: list[int] = []
        self.update_ready = landing is not None
        if landing is None:  # staleness=1, first step: nothing averaged yet, nothing to apply
            self._zero_grads()
        else:
            bad_params = self._land(landing, used_counts, used_handle)
        self.last_step_skipped = bool(bad_params)
        exposed_s = time.perf_counter() - start
        if not self.merged:
            self._merge_by_cost()
        now = _counters(self.comm)
        moves = None if self.compressor is None else self.compressor.state_moves
        extra = 0 if used_counts is None else 1
        self.last_stats = StepStats(
            step=self.step,
            num_buckets=len(self.buckets),
            num_collectives=0
            if self.config.skip_communication
            else len(self.buckets) * (2 if self._agrees_first else 1) + extra,
            bytes_sent=now.bytes_sent - self._baseline.bytes_sent,
            native_bytes=now.native_bytes - self._baseline.native_bytes,
            exposed_comm_s=exposed_s,
            launched_after_grads=tuple(self._flight.launched_after),
            skipped=self.last_step_skipped,
            gradient_step=-1 if landing is None else landing.step,
            state_moved_numel=0 if moves is None else moves.moved_numel,
            state_dropped_numel=0 if moves is None else moves.dropped_numel,
        )
        self._baseline = now

    def _land(
        self, flight: Flight, used_counts: torch.Tensor | None, used_handle: Any
    ) -> list[int]:
        """Wait for ``flight``'s buckets and copy their averages into ``.grad``; returns the
        non-finite parameters (then every gradient is zeroed, ``_on_nonfinite``)."""
        bad: list[tuple[int, int]] = []  # (rank, parameter); ranks known only when compressed
        bad_params: list[int] = []
        copy = used_counts is None  # else wait for the counts: unused parameters keep .grad
        with self.comm.at_step(flight.step):
            # Bucket by bucket, in launch order: check and copy back each one while the later
            # ones are still on the wire (torch DDP copies back only after the last one).
            for bucket, handle in zip(flight.buckets, flight.handles, strict=True):
                result = handle.result()
                if isinstance(result, list):
                    bad += result  # compressed: the job agreed on finiteness before sending
                else:
                    bad_params += [bucket.params[slot] for slot in nonfinite_slots(bucket)]
                copy = copy and not bad and not bad_params
                if copy:
                    self._copy_back(bucket, None)
            if used_handle is not None:
                used_handle.wait()
        bad_params = sorted({index for _, index in bad} | set(bad_params))
        if bad_params:
            self._on_nonfinite(
                bad_params, sorted({rank for rank, _ in bad if rank >= 0}), flight.step
            )
        elif used_counts is not None:
            for bucket in flight.buckets:
                self._copy_back(bucket, used_counts)
        return bad_params

    def land_in_flight(self) -> dict[str, Any] | None:
        """staleness=1: wait for the reduction still in flight and return it as checkpoint state
        (``Flight.state_dict``; None when nothing is in flight). It stays pending, to be applied
        at the next step as if nothing had happened."""
        if self._in_flight is None:
            return None
        self._in_flight = self._in_flight.landed()
        return self._in_flight.state_dict()

    def restore_in_flight(self, state: dict[str, Any] | None) -> None:
        """Inverse of ``land_in_flight`` on a resumed engine (same bucket layout)."""
        self._in_flight = None if state is None else Flight.from_state(state, self.buckets)

    def _zero_grads(self) -> None:
        """Zero every ``.grad``: a step with nothing (finite) to apply changes no replica."""
        with torch.no_grad():
            for param in self.params:
                if param.grad is not None:
                    param.grad.zero_()

    def _on_nonfinite(self, bad_params: list[int], bad_ranks: list[int], step: int) -> None:
        names = ", ".join(self.names[i] for i in bad_params)
        where = f" on rank(s) {bad_ranks}" if bad_ranks else ""
        message = f"non-finite (NaN/Inf) gradient at step {step}{where} in: {names}"
        self._zero_grads()
        # Set here, not by the caller: with "raise" the caller never resumes, and a step()
        # after a caught error must not step either.
        self.last_step_skipped = True
        if self.config.on_nonfinite == "raise":
            raise NonFiniteGradientError(message)
        warnings.warn(message + "; gradients zeroed, step skipped", RuntimeWarning, stacklevel=2)

    def _copy_back(self, bucket: Bucket, used_counts: torch.Tensor | None) -> None:
        """Hand each averaged slot to its parameter. Without staleness the slot itself becomes
        ``.grad`` (torch DDP's ``gradient_as_bucket_view``): no copy now, and none at the next
        step's hook either when ``.grad`` survives (``zero_grad(set_to_none=False)``), since
        autograd then accumulates straight into the bucket: one or two bucket-sized copies
        fewer per step. With
        staleness=1 the buffers alternate between steps, so ``.grad`` gets a copy."""
        views = not self.config.staleness
        with torch.no_grad():
            for slot, index in enumerate(bucket.params):
                if used_counts is not None and int(used_counts[index]) == 0:
                    continue  # no rank used it: leave .grad as it was (torch DDP's rule)
                param = self.params[index]
                averaged = bucket.view(slot).view(param.shape)
                if views:
                    param.grad = averaged
                elif param.grad is None:
                    param.grad = averaged.clone()
                else:
                    param.grad.copy_(averaged)

    def _merge_by_cost(self) -> None:
        """Re-bucket once from this step's arrival times (rank 0's, so every rank agrees)."""
        from commfuse.collectives import tuner
        from commfuse.collectives.profile import profile_of

        self.merged = True
        order = [i for group in self.groups for i in group]
        ready = torch.tensor(
            [self.arrival_s[i] for i in order],
            dtype=torch.float64,
            device=self.buckets[0].flat.device,
        )
        broadcast(self.comm, ready, 0, algo="native")
        profile = profile_of(self.comm)
        world = self.comm.world_size
        algo = self.config.algo

        def cost(nbytes: int) -> float:
            name = (
                tuner.choose_for("all_reduce", nbytes, world, profile) if algo == "auto" else algo
            )
            return tuner.predict("all_reduce", name, nbytes, world, profile)

        sizes = [self.params[i].numel() * self.params[i].element_size() for i in order]
        dtypes = [self.params[i].dtype for i in order]
        runs: list[list[int]] = []  # merge only within runs of one dtype
        for position, dtype in enumerate(dtypes):
            if runs and dtypes[runs[-1][-1]] == dtype:
                runs[-1].append(position)
            else:
                runs.append([position])
        groups = []
        for run in runs:
            merged = merge_by_cost([sizes[p] for p in run], [float(ready[p]) for p in run], cost)
            groups.extend([[order[run[p]] for p in group] for group in merged])
        self.set_layout(groups)

"""The pipeline runtime: one rank's share of a lowered schedule over deadline-bounded sends.

torch's pipelining posts each step's messages with ``batch_isend_irecv``, which has no stable
gloo implementation and hangs on CPU (pytorch#132644, PiPPy#1130). Here every message is a
plain ``Communicator.isend``/``irecv``, in the lowered schedule's order, each with a tag of its
own, and every wait has the communicator's deadline.

1. ``RECV`` posts the receive of a shape header (``HEADER_SLOTS`` int64: rank, dtype, sizes);
   before each compute action the rank posts the payload's receive of any header that arrived,
   so a transfer overlaps the compute of the micro-batches around it. Micro-batches may differ
   in size and length: the header says each one's shape.
2. ``F`` runs the stage on its input (the caller's micro-batch on the first stage, else the
   received or locally handed activation); the last stage adds ``weight_m * loss_fn(out, y)``.
3. ``B`` back-propagates the output's gradient (the loss on the last stage); ``I`` computes only
   the input's gradient and ``W`` later the weights' (Qi et al., ICLR 2024), both exact.
4. ``SEND`` posts the header and the tensor; the step waits for every send before it returns.
   A ``Boundary`` (``boundary.py``) turns the tensor into its wire payload (fp16, bf16, int8,
   AQ-SGD deltas) at every stage boundary and back, the header keeping its shape and dtype.

Gradients are flushed per step: they accumulate over the step's micro-batches, and with a
mean loss and ``weight_m = n_m / N`` (the default) they equal the unsplit model's on the whole
batch. A wait that fails (a peer died, a deadline passed) raises ``PipelineError`` naming rank,
stage, micro-batch and action. Every buffer is made on the stages' device. With
``CommConfig(trace=True)`` each compute action joins the messages in the communicator's trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from commfuse.comm import CommError, Communicator, Handle, TraceEvent
from commfuse.comm.trace import now_us
from commfuse.pipeline.actions import Action
from commfuse.pipeline.boundary import Boundary, DeltaCache
from commfuse.pipeline.lower import lower
from commfuse.pipeline.schedule import Schedule
from commfuse.pipeline.validate import validate

#: int64 slots of a shape header: dtype code, number of dimensions, then the sizes.
HEADER_SLOTS = 10
MAX_DIMS = HEADER_SLOTS - 2
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
#: The stats/trace labels of the runtime's messages.
LABELS = {"F": "pipeline.activation", "B": "pipeline.gradient", "header": "pipeline.header"}

Key = tuple[str, int, int]  # ("F" or "B", the stage that uses it, micro-batch)


class PipelineError(RuntimeError):
    """A pipeline step could not finish; names rank, stage, micro-batch and action. The
    communicator's error (``CommTimeoutError``, ``PeerFailureError``) is its ``__cause__``."""

    def __init__(self, message: str, *, rank: int, stage: int, microbatch: int | None, action: str):
        super().__init__(message)
        self.rank, self.stage, self.microbatch, self.action = rank, stage, microbatch, action

    def __reduce__(self) -> tuple[object, ...]:
        fields = (self.rank, self.stage, self.microbatch, self.action)
        return (_rebuild, (str(self), *fields))


def _rebuild(
    message: str, rank: int, stage: int, microbatch: int | None, action: str
) -> PipelineError:
    return PipelineError(message, rank=rank, stage=stage, microbatch=microbatch, action=action)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one ``PipelineRuntime.step`` gives back."""

    loss: float | None
    """The step's loss, ``sum_m weight_m * loss_m``, on the rank holding the last stage; None
    on the others."""
    microbatch_losses: tuple[float, ...]
    """Each micro-batch's unweighted loss on that rank (empty elsewhere)."""


@dataclasses.dataclass
class _Recv:
    src: int
    header: torch.Tensor
    header_handle: Handle
    payload: torch.Tensor | None = None
    payload_handle: Handle | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(
            f"a stage boundary carries a {t.dim()}-d {t.dtype} tensor; the header holds up to "
            f"{MAX_DIMS} dimensions of {', '.join(str(d) for d in _DTYPES)}"
        )
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(
        values + [0] * (HEADER_SLOTS - len(values)), dtype=torch.int64, device=t.device
    )


class PipelineRuntime:
    """Run this rank's share of ``schedule`` (module docstring).

    Args:
        schedule: a schedule (lowered here if it is not) for ``comm``'s world size.
        stages: this rank's stage modules by stage index (``cut`` makes them).
        comm: the communicator; None only for a schedule on one rank.
        loss_fn: ``loss_fn(output, target)`` of the last stage, a scalar (a mean keeps the
            default weights exact).
        device: where buffers go; None: the stages' parameters' device (CPU without any).
        boundary: how activations and gradients cross every stage boundary (``Boundary``:
            identity, fp16, bf16, int8, AQ-SGD deltas, a subspace); the same on every rank.

    Raises:
        ValueError: ``stages`` is not this rank's stages, the schedule's ranks are not the
            communicator's, or it fails ``validate``.

    Example:
        ```python
        stages = cut(model, [2, 4, 6])
        schedule = one_f_one_b(num_stages=4, num_microbatches=8)
        mine = {s: stages[s] for s in range(4) if schedule.stage_to_rank[s] == comm.rank}
        runtime = PipelineRuntime(schedule, mine, comm, loss_fn=nn.functional.mse_loss)
        result = runtime.step(inputs=x.chunk(8), targets=y.chunk(8))  # then optimizer.step()
        ```
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        comm: Communicator | None,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device | None = None,
        boundary: Boundary | None = None,
    ) -> None:
        self.boundary = boundary or Boundary()
        if not isinstance(self.boundary, Boundary):
            raise TypeError(f"boundary must be a Boundary, got {type(boundary).__name__}")
        #: AQ-SGD's caches: what this rank sent and what it received, per (stage, sample).
        self.sent_cache, self.received_cache = DeltaCache(), DeltaCache()
        self.schedule = schedule if schedule.is_lowered else lower(schedule)
        validate(self.schedule)
        world = comm.world_size if comm is not None else 1
        if world != schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks; the communicator "
                f"has {world}"
            )
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        mine = {s for s, r in enumerate(schedule.stage_to_rank) if r == self.rank}
        if set(stages) != mine:
            raise ValueError(
                f"rank {self.rank} holds stages {sorted(mine)} in schedule {schedule.name!r}; "
                f"got modules for {sorted(stages)}"
            )
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.device = device or (params[0].device if params else torch.device("cpu"))
        self.step_count = 0

    def state_dict(self) -> dict[str, Any]:
        """The step count and the boundary's caches (AQ-SGD), for an exact resume."""
        return {
            "step_count": self.step_count,
            "boundary": str(self.boundary),
            "sent_cache": self.sent_cache.state_dict(),
            "received_cache": self.received_cache.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s state; refuses one written with another boundary."""
        if state["boundary"] != str(self.boundary):
            raise ValueError(
                f"the checkpoint's boundary is {state['boundary']!r}; this runtime's is "
                f"{str(self.boundary)!r}"
            )
        self.step_count = int(state["step_count"])
        self.sent_cache.load_state_dict(state["sent_cache"], self.device)
        self.received_cache.load_state_dict(state["received_cache"], self.device)

    def step(
        self,
        inputs: Sequence[torch.Tensor] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
        *,
        loss_weights: Sequence[float] | None = None,
        sample_ids: Sequence[torch.Tensor] | None = None,
    ) -> StepResult:
        """One step: every micro-batch forward and backward, gradients accumulated into the
        stages' ``.grad`` (call the optimizer after it).

        Args:
            inputs: the micro-batches, on the rank holding stage 0 (None elsewhere).
            targets: their targets, on the rank holding the last stage (None elsewhere).
            loss_weights: each micro-batch's weight in the step's loss; None: its share of the
                batch, ``n_m / N`` with ``n_m`` its targets' first dimension.
            sample_ids: each micro-batch's sample indices (one per row of its first
                dimension), on every rank; needed by a delta boundary, unused otherwise.

        Returns:
            The loss on the last stage's rank.

        Raises:
            ValueError: inputs, targets, loss weights or sample ids missing where they are
                needed, or not one per micro-batch.
            PipelineError: a wait failed (a peer died or a deadline passed).
        """
        run = _Step(self, inputs, targets, loss_weights, _checked_ids(self, sample_ids))
        with torch.enable_grad():
            run.execute()
        self.step_count += 1
        return run.result()


def _checked_ids(
    runtime: PipelineRuntime, sample_ids: Sequence[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The step's sample ids, checked where a delta boundary needs them (else unused)."""
    if not runtime.boundary.delta:
        return []
    m = runtime.schedule.num_microbatches
    if sample_ids is None or len(sample_ids) != m:
        got = "none" if sample_ids is None else len(sample_ids)
        raise ValueError(
            f"Boundary({runtime.boundary}) keeps each sample's activation: step needs "
            f"sample_ids on every rank, one tensor per micro-batch ({m}), got {got}"
        )
    # Ids are bookkeeping read on the host (the caches are keyed by them), never sent.
    ids = [torch.as_tensor(t, dtype=torch.int64, device="cpu").reshape(-1) for t in sample_ids]
    flat = torch.cat(ids)
    if len(set(flat.tolist())) != flat.numel():
        raise ValueError("sample_ids repeat a sample within one step; each sample once a step")
    return ids


class _Step:
    """One step's state on one rank: what arrived, what waits to be sent, the autograd graphs."""

    def __init__(
        self,
        runtime: PipelineRuntime,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        loss_weights: Sequence[float] | None,
        sample_ids: list[torch.Tensor],
    ) -> None:
        self.rt = runtime
        self.ids = sample_ids
        s = runtime.schedule
        self.last = s.num_stages - 1
        m = s.num_microbatches
        holds_first, holds_last = 0 in runtime.stages, self.last in runtime.stages
        for name, given, needed in (
            ("inputs", inputs, holds_first),
            ("targets", targets, holds_last),
        ):
            if needed and (given is None or len(given) != m):
                count = "none" if given is None else len(given)
                raise ValueError(
                    f"rank {runtime.rank} holds stage {0 if name == 'inputs' else self.last}: it "
                    f"needs {m} {name} (one per micro-batch), got {count}"
                )
        self.inputs = [t.to(runtime.device) for t in inputs] if holds_first and inputs else []
        self.targets = [t.to(runtime.device) for t in targets] if holds_last and targets else []
        self.weights: list[float] = []
        if loss_weights is not None:
            if len(loss_weights) != m:
                raise ValueError(
                    f"loss_weights has {len(loss_weights)} weights for {m} micro-batches"
                )
            self.weights = [float(w) for w in loss_weights]
        elif self.targets:
            total = sum(t.shape[0] if t.dim() else 1 for t in self.targets)
            self.weights = [(t.shape[0] if t.dim() else 1) / total for t in self.targets]
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending_w: dict[tuple[int, int], torch.Tensor | None] = {}
        self.local: dict[Key, torch.Tensor] = {}
        self.outbox: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}  # header, payload
        self.recvs: dict[Key, _Recv] = {}
        self.sends: list[tuple[Action, Handle, torch.Tensor]] = []
        self.losses: list[float] = []
        self.loss = 0.0

    # -- the loop -------------------------------------------------------------------------
    def execute(self) -> None:
        rank = self.rt.rank
        for action in self.rt.schedule.actions[rank]:
            if action is None or action.microbatch is None:
                continue  # idle steps and torch's memory actions
            try:
                if action.is_compute:
                    self._progress()
                    self._await_inputs(action)
                    with self._traced(action):
                        getattr(self, f"_do_{action.kind}")(action)
                else:
                    getattr(self, f"_do_{action.kind}")(action)
            except CommError as err:
                raise self._error(action, err) from err
        for action, handle, _tensor in self.sends:
            try:
                handle.wait()
            except CommError as err:
                raise self._error(action, err) from err

    def _await_inputs(self, action: Action) -> None:
        """Wait for what ``action`` receives before it starts, so that its trace event holds
        its compute alone and the wait shows as idle time."""
        s, m = action.stage, action.microbatch
        assert m is not None
        key: Key | None = None
        if action.kind == "F" and s > 0:
            key = ("F", s, m)
        elif action.kind in ("B", "I") and s < self.last:
            key = ("B", s, m)
        if key is not None and key in self.recvs:
            self.local[key] = self._take(key, action)

    @contextlib.contextmanager
    def _traced(self, action: Action) -> Iterator[None]:
        """A compute action in the communicator's trace (when it keeps one), beside its
        messages: the step's whole timeline in one Chrome trace."""
        comm = self.rt.comm
        if comm is None or not comm.config.trace:
            yield
            return
        event = TraceEvent(
            kind=f"pipeline {action}",
            rank=comm.global_rank_of_self,
            peer=None,
            nbytes=0,
            start_us=now_us(),
            step=self.rt.step_count,
            group=comm.name,
        )
        comm.trace.events.append(event)
        try:
            yield
        finally:
            event.end_us = now_us()

    def result(self) -> StepResult:
        if self.last not in self.rt.stages:
            return StepResult(loss=None, microbatch_losses=())
        return StepResult(loss=self.loss, microbatch_losses=tuple(self.losses))

    def _error(self, action: Action, err: CommError) -> PipelineError:
        where = (
            f"rank {self.rt.rank}, pipeline step {self.rt.step_count}, stage {action.stage}, "
            f"micro-batch {action.microbatch}, action {action}"
        )
        return PipelineError(
            f"{where}: {err}",
            rank=self.rt.rank,
            stage=action.stage,
            microbatch=action.microbatch,
            action=str(action),
        )

    # -- messages -------------------------------------------------------------------------
    def _tag(self, key: Key, part: int) -> int:
        kind, stage, mb = key
        s = self.rt.schedule
        return 1 + ((mb * s.num_stages + stage) * 2 + (kind == "B")) * 2 + part

    def _hand(self, key: Key, tensor: torch.Tensor) -> None:
        """Give ``tensor`` to the stage ``key`` names through the boundary: decoded here if
        that stage is on this rank, else queued for the schedule's ``SEND``."""
        payload = self._encode(key, tensor.detach().contiguous())
        if self.rt.schedule.stage_to_rank[key[1]] == self.rt.rank:
            self.local[key] = (
                tensor
                if self.rt.boundary.is_identity
                else self._decode(key, payload, tuple(tensor.shape), tensor.dtype)
            )
        else:
            self.outbox[key] = (_header(tensor), payload)

    def _delta_ids(self, key: Key, rows: int) -> torch.Tensor | None:
        """The sample ids of ``key``'s micro-batch where its tensor is sent as a delta."""
        if key[0] != "F" or not self.rt.boundary.delta:
            return None
        ids = self.ids[key[2]]
        if ids.numel() != rows:
            raise ValueError(
                f"micro-batch {key[2]} has {ids.numel()} sample ids for an activation of "
                f"{rows} rows entering stage {key[1]}"
            )
        return ids

    def _encode(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        """The payload of ``tensor``; a delta boundary's sender updates its cache here."""
        b, where = self.rt.boundary, f"the boundary into stage {key[1]}"
        ids = self._delta_ids(key, tensor.shape[0] if tensor.dim() else 1)
        if ids is None:
            return b.encode(tensor, where=where)
        cache = self.rt.sent_cache
        ref = cache.gather(key[1], ids, tensor)
        payload = b.encode(tensor - ref, where=where)
        cache.scatter(key[1], ids, ref + b.decode(payload, tensor.shape, tensor.dtype))
        return payload

    def _decode(
        self, key: Key, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The tensor ``payload`` stands for; a delta boundary's receiver updates its cache."""
        b = self.rt.boundary
        value = b.decode(payload, shape, dtype)
        ids = self._delta_ids(key, shape[0] if shape else 1)
        if ids is None:
            return value
        cache = self.rt.received_cache
        value = cache.gather(key[1], ids, value) + value
        cache.scatter(key[1], ids, value)
        return value

    def _send(self, action: Action, key: Key) -> None:
        comm = self.rt.comm
        assert comm is not None, "a send in a one-rank schedule"
        header, payload = self.outbox.pop(key)
        dst = self.rt.schedule.stage_to_rank[key[1]]
        for part, t, label in ((0, header, LABELS["header"]), (1, payload, LABELS[key[0]])):
            handle = comm.isend(t, dst, tag=self._tag(key, part), label=label)
            self.sends.append((action, handle, t))

    def _post(self, key: Key, src_stage: int) -> None:
        comm = self.rt.comm
        assert comm is not None, "a receive in a one-rank schedule"
        src = self.rt.schedule.stage_to_rank[src_stage]
        header = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.rt.device)
        handle = comm.irecv(header, src, tag=self._tag(key, 0), label=LABELS["header"])
        self.recvs[key] = _Recv(src=src, header=header, header_handle=handle)

    def _post_payload(self, key: Key, recv: _Recv) -> None:
        comm = self.rt.comm
        assert comm is not None
        recv.header_handle.wait()
        code, ndim, *sizes = recv.header.tolist()
        recv.shape, recv.dtype = tuple(sizes[:ndim]), _DTYPES[code]
        b = self.rt.boundary
        recv.payload = (
            torch.empty(recv.shape, dtype=recv.dtype, device=self.rt.device)
            if b.is_identity
            else torch.empty(
                b.payload_bytes(recv.shape, recv.dtype), dtype=torch.uint8, device=self.rt.device
            )
        )
        recv.payload_handle = comm.irecv(
            recv.payload, recv.src, tag=self._tag(key, 1), label=LABELS[key[0]]
        )

    def _progress(self) -> None:
        """Post the payload receive of every header that has arrived (module docstring, 1)."""
        for key, recv in self.recvs.items():
            if recv.payload_handle is None and recv.header_handle.is_completed():
                self._post_payload(key, recv)

    def _take(self, key: Key, action: Action) -> torch.Tensor:
        if key in self.local:
            return self.local.pop(key)
        recv = self.recvs.pop(key, None)
        if recv is None:
            raise PipelineError(
                f"rank {self.rt.rank}: {action} needs its {'input' if key[0] == 'F' else 'gradient'}"
                " but no receive was posted for it (a lowered schedule without its RECV)",
                rank=self.rt.rank,
                stage=action.stage,
                microbatch=action.microbatch,
                action=str(action),
            )
        if recv.payload_handle is None:
            self._post_payload(key, recv)
        assert recv.payload_handle is not None and recv.payload is not None
        recv.payload_handle.wait()
        return self._decode(key, recv.payload, recv.shape, recv.dtype)

    # -- the actions ----------------------------------------------------------------------
    def _do_F(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        assert m is not None
        if s == 0:
            x = self.inputs[m]
        else:
            x = self._take(("F", s, m), a).detach()
            x.requires_grad_(x.is_floating_point())
        out = self.rt.stages[s](x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"stage {s} returned {type(out).__name__}; a stage takes one tensor and returns "
                "one (wrap a module with several outputs so that it returns one tensor)"
            )
        if s == self.last:
            loss = self.rt.loss_fn(out, self.targets[m])
            self.losses.append(float(loss.detach()))
            out = loss * self.weights[m]
            self.loss += float(out.detach())
        else:
            self._hand(("F", s + 1, m), out.detach())
        self.graphs[(s, m)] = (x, out)

    def _grad_of_output(self, s: int, m: int, a: Action) -> torch.Tensor | None:
        return None if s == self.last else self._take(("B", s, m), a)

    def _do_B(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        assert m is not None
        grad = self._grad_of_output(s, m, a)
        x, out = self.graphs.pop((s, m))
        torch.autograd.backward(out, grad)
        if s > 0:
            self._hand(("B", s - 1, m), x.grad if x.grad is not None else torch.zeros_like(x))

    def _do_I(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        assert m is not None
        grad = self._grad_of_output(s, m, a)
        x, out = self.graphs[(s, m)]
        self.pending_w[(s, m)] = grad
        if s > 0 and x.requires_grad:
            (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True, allow_unused=True)
            self._hand(("B", s - 1, m), gx if gx is not None else torch.zeros_like(x))

    def _do_W(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        assert m is not None
        grad = self.pending_w.pop((s, m))
        _x, out = self.graphs.pop((s, m))
        params = [p for p in self.rt.stages[s].parameters() if p.requires_grad]
        if not params:
            return
        grads = torch.autograd.grad(out, params, grad, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)

    def _do_SEND_F(self, a: Action) -> None:
        assert a.microbatch is not None
        self._send(a, ("F", a.stage + 1, a.microbatch))

    def _do_SEND_B(self, a: Action) -> None:
        assert a.microbatch is not None
        self._send(a, ("B", a.stage - 1, a.microbatch))

    def _do_RECV_F(self, a: Action) -> None:
        assert a.microbatch is not None
        self._post(("F", a.stage, a.microbatch), a.stage - 1)

    def _do_RECV_B(self, a: Action) -> None:
        assert a.microbatch is not None
        self._post(("B", a.stage, a.microbatch), a.stage + 1)

"""``PeriodicSyncOptimizer``: local SGD, post-local SGD, SlowMo, DiLoCo and streaming DiLoCo as
one optimizer wrapper.

Use it like PyTorch's ``PostLocalSGDOptimizer``: wrap the inner optimizer, call ``step()``
after each backward. No gradient communication happens between synchronisations (the model is
*not* wrapped in DDP); every rank trains its replica on its own data, and every H steps (per
fragment) the replicas exchange their pseudo-gradients and apply the outer step
(``outer.py``)::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = PeriodicSyncOptimizer(inner, model, comm, diloco(H=50))
    for batch in data:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()

What happens in ``step()``:

1. During the first ``warmup_steps`` (post-local SGD) gradients are averaged over all ranks
   before the inner step; with ``hierarchical``, inside each host every step instead, and the
   periodic exchange runs only between hosts.
2. The inner optimizer steps.
3. For each fragment due, ``delta = anchor - params`` is averaged (an allreduce, or a
   compressor with error feedback) and the outer step applied; with ``overlap_steps = tau``
   (streaming DiLoCo) the exchange runs while the next tau inner steps run.
4. ``finish()`` lands the exchanges in flight and (``final_sync``) averages every fragment that
   moved since its last exchange, so every rank ends with one model.

Design notes: ``docs/local-sgd.md``, "The periodic optimizer's step, metrics and checkpoint".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commfuse import collectives
from commfuse.comm import Communicator
from commfuse.localsgd.config import PeriodicMethod
from commfuse.localsgd.fragments import fragments_due, split_into_fragments
from commfuse.localsgd.outer import outer_sgd_
from commfuse.localsgd.sharded import check_shards, local_view, refuse_data_parallel


@dataclass(kw_only=True)
class SyncRecord:
    """One synchronisation of one fragment."""

    step: int
    """Inner step after which the exchange started."""
    fragment: int
    numel: int
    """Elements exchanged."""
    drift: float
    """L2 distance between this replica and the replicas' average before the exchange."""
    relative_drift: float
    """``drift`` divided by the L2 norm of the anchor."""


@dataclass(kw_only=True)
class _Pending:
    fragment: int
    sent_at_step: int
    apply_at_step: int
    delta_avg: torch.Tensor
    """This replica's delta when sent; the replicas' average once the exchange finished."""
    local_delta: torch.Tensor
    """This replica's delta as sent (for the drift)."""
    handle: Any  # a collective handle, or None once finished


class PeriodicSyncOptimizer:
    """See the module docstring.

    Args:
        optimizer: the inner optimizer (AdamW for DiLoCo), over ``module``'s parameters.
        module: the replica; its parameters are the anchors' starting point. An FSDP2-sharded
            replica (DTensor parameters) is averaged shard by shard (``sharded.py``).
        comm: the group of replicas to average over (of a sharded replica: the ranks that
            hold the same shard in every replica, ``mesh["replicate"]``).
        config: the method (``local_sgd(H=8)``, ``diloco(H=50)``, ...: a ``PeriodicMethod``),
            run as its ``periodic()`` config (``self.config``).

    Raises:
        ValueError: a module with no trainable parameters, or parameters that are not contiguous
            (fragments are views of them); a module wrapped in ``DistributedDataParallel``
            over ranks of ``comm``; a DTensor parameter placed other than ``Shard(0)`` or
            ``Replicate()``, or on a mesh that shares ranks with ``comm`` (``sharded.py``).
        CommTimeoutError: an exchange passed the communicator's deadline.

    Example:
        ```python
        opt = PeriodicSyncOptimizer(torch.optim.AdamW(net.parameters()), net, comm, diloco(H=50))
        for batch in data:
            loss_fn(net(batch)).backward()
            opt.step()  # an inner step; every H steps the outer step on the averaged delta
            opt.zero_grad()
        opt.finish()  # one model on every rank
        ```
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        comm: Communicator,
        config: PeriodicMethod,
    ) -> None:
        self.inner = optimizer
        self.config = config = config.periodic()
        self.world_comm = comm
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        refuse_data_parallel(module, comm)
        check_shards(named, comm)
        if config.hierarchical:
            self.grad_comm, self.outer_comm = comm.split_by_host(config.ranks_per_host)
        else:
            self.grad_comm, self.outer_comm = comm, comm
        if not all(local_view(p).is_contiguous() for p in self.params):
            raise ValueError(
                "PeriodicSyncOptimizer needs contiguous parameters (fragments are views)"
            )
        # DTensor parameters (FSDP2): everything below runs on this rank's shards.
        self.fragments = split_into_fragments(
            [local_view(p) for p in self.params], config.num_fragments
        )
        # Replicas must start equal: rank 0's parameters everywhere.
        with torch.no_grad():
            for p in self.params:
                collectives.broadcast(comm, local_view(p), 0, algo="native")
        self.anchors = [self._flat(f).clone() for f in range(len(self.fragments))]
        use_momentum = config.outer_momentum > 0
        self.momenta = [torch.zeros_like(a) if use_momentum else None for a in self.anchors]
        self.step_count = 0
        self.in_sync_at = [0] * len(self.fragments)
        """Per fragment, the last step after which every replica held exactly the anchor (an
        exchange written without mixing, or the synchronous warm-up)."""
        self.syncs: list[SyncRecord] = []
        self._pending: list[_Pending] = []
        self.exchanges_started = 0
        """Exchanges begun so far (the compressor's step index: the same on every rank)."""
        self.control_bytes = 0
        """Bytes this rank sent to decide what to exchange, not exchanges (0 on a fixed period;
        SelSync's flags, ADPSGD's periods, DreamDDP's profile: ``commfuse.localsgd.SyncMethod``)."""
        # The compressor's state (error feedback) is this optimizer's from here on.
        self._compressor = config.compressor

    # -- the optimizer interface ------------------------------------------------------------
    # ``param_groups``, ``defaults`` and ``state`` are the inner optimizer's, and ``step`` takes
    # a closure: trainers that check an optimizer's shape (Lightning's ``Optimizable``) or step
    # it with a closure (Lightning, Accelerate) accept this one as they would a torch optimizer.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step, then whatever synchronisation is due (see the module docstring).

        Args:
            closure: computes the loss and its gradients before the step (as torch
                optimizers take it); its result is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        warm = self.step_count < self.config.warmup_steps
        if warm:
            self._average_gradients(self.world_comm)
        elif self.config.hierarchical:
            self._average_gradients(self.grad_comm)
        self._inner_step(1.0 if warm else self.config.inner_lr_scale)
        self.step_count += 1
        if warm or self.step_count == self.config.warmup_steps:
            # Still synchronous: replicas are equal, so the anchor simply follows them.
            for f, anchor in enumerate(self.anchors):
                anchor.copy_(self._flat(f))
                self.in_sync_at[f] = self.step_count
            return
        self._apply_arrived()
        periodic_step = self.step_count - self.config.warmup_steps
        for f in fragments_due(periodic_step, len(self.fragments), self.config.H):
            self._start_exchange(f)
        self._apply_arrived()

    def _inner_step(self, lr_scale: float) -> None:
        """The inner optimizer's step with its learning rates scaled for this step only (a
        scheduler's own values are left as they were)."""
        if lr_scale == 1.0:
            self.inner.step()
            return
        saved = [group["lr"] for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self.inner.step()
        finally:
            for group, lr in zip(self.inner.param_groups, saved, strict=True):
                group["lr"] = lr

    def finish(self) -> None:
        """End of training: wait for and apply every exchange in flight, then (``final_sync``)
        replace each fragment whose replicas moved since its last exchange by the replicas'
        average, so that every rank ends with the same model. Calling it again changes nothing.

        The average, not an outer step: the outer momentum extrapolates for the period that
        follows, and there is none. Measured on charlm (streaming DiLoCo, 4 fragments, from a
        200-step DDP model plus 200 steps): held-out loss 1.809 with the average, 1.816 with an
        outer step on the partial periods, 1.855 without the final synchronisation (rank 0's
        replica); DiLoCo's own synchronised model 1.801."""
        self.land_in_flight()
        if self.config.final_sync:
            self.average_moved_fragments()

    def land_in_flight(self) -> None:
        """Wait for and apply every exchange in flight now (``finish()``'s first half). With
        ``final_sync`` it is written exactly, not mixed with the local steps taken meanwhile,
        so its fragment is in sync and is not sent a second time."""
        for pending in self._pending:
            pending.apply_at_step = self.step_count
        self._apply_arrived(mix=not self.config.final_sync)

    def average_moved_fragments(self) -> None:
        """Replace every fragment that moved since its last exchange by the replicas' average
        (``finish()``'s second half)."""
        # ``in_sync_at`` is the same on every rank (every rank takes the same steps), so every
        # rank exchanges the same fragments without asking the others.
        for f, step in enumerate(self.in_sync_at):
            if step != self.step_count:
                self._start_exchange(f, background=False)
                self._apply(self._pending.pop(), mix=False, average=True)

    # -- internals --------------------------------------------------------------------------
    def _flat(self, fragment: int) -> torch.Tensor:
        return torch.cat(
            [
                local_view(self.params[piece.param]).view(-1)[piece.start : piece.stop]
                for piece in self.fragments[fragment]
            ]
        )

    def _write(self, fragment: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for piece in self.fragments[fragment]:
                target = local_view(self.params[piece.param]).view(-1)[piece.start : piece.stop]
                target.copy_(flat[offset : offset + piece.numel])
                offset += piece.numel

    def _average_gradients(self, comm: Communicator) -> None:
        if comm.world_size == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_view(p.grad) for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(comm, flat, "avg", algo=self.config.algo)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _start_exchange(self, fragment: int, *, background: bool = True) -> None:
        delta = self.anchors[fragment] - self._flat(fragment)
        local = delta.clone()  # before the exchange averages ``delta`` in place
        sync_index = self.exchanges_started
        self.exchanges_started += 1
        comm = self.outer_comm

        def exchange() -> None:
            if comm.world_size == 1:
                return
            if self._compressor is not None:
                self._compressor.reduce_(comm, delta, bucket=fragment, step=sync_index)
            else:
                collectives.all_reduce(comm, delta, "avg", algo=self.config.algo)

        if background and self.config.overlap_steps > 0:
            handle = comm.submit(f"outer exchange of fragment {fragment}", exchange)
        else:
            exchange()
            handle = None
        self._pending.append(
            _Pending(
                fragment=fragment,
                sent_at_step=self.step_count,
                apply_at_step=self.step_count + self.config.overlap_steps,
                delta_avg=delta,
                local_delta=local,
                handle=handle,
            )
        )

    def _apply_arrived(self, *, mix: bool = True) -> None:
        keep: list[_Pending] = []
        for pending in self._pending:
            if pending.apply_at_step > self.step_count:
                keep.append(pending)
                continue
            if pending.handle is not None:
                pending.handle.wait()
                pending.handle = None
            self._apply(pending, mix=mix)
        self._pending = keep

    def _apply(self, pending: _Pending, *, mix: bool = True, average: bool = False) -> None:
        """Apply an arrived exchange: the outer step on the anchor (``average``: the plain
        average of the replicas instead, momentum untouched), then the parameters restart from
        the anchor, or from its mix with the local values (``mix`` and streaming's mix_global)."""
        f, avg = pending.fragment, pending.delta_avg
        anchor = self.anchors[f]
        # The drift is known once the average is.
        drift = float((pending.local_delta - avg).norm())
        scale = float(anchor.norm()) or 1.0
        self.syncs.append(
            SyncRecord(
                step=pending.sent_at_step,
                fragment=f,
                numel=avg.numel(),
                drift=drift,
                relative_drift=drift / scale,
            )
        )
        cfg = self.config
        if average:
            anchor.sub_(avg)  # anchor - mean(anchor - params) = mean(params)
        else:
            outer_sgd_(
                anchor,
                avg,
                self.momenta[f],
                lr=cfg.outer_lr,
                mu=cfg.outer_momentum,
                nesterov=cfg.nesterov,
            )
        if mix and cfg.overlap_steps > 0 and cfg.mix_global < 1.0:
            merged = anchor * cfg.mix_global + self._flat(f) * (1.0 - cfg.mix_global)
            self._write(f, merged)
        else:
            self._write(f, anchor)
            self.in_sync_at[f] = self.step_count

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: inner optimizer, step counter, anchors, outer
        momenta, exchanges in flight (waited for, stored with their local deltas), and the
        compressor's state (error feedback). Of an FSDP2-sharded replica it holds this rank's
        shards only: each rank saves and loads its own."""
        pending = []
        for p in self._pending:
            if p.handle is not None:
                p.handle.wait()
                p.handle = None
            pending.append(
                {
                    "fragment": p.fragment,
                    "sent_at_step": p.sent_at_step,
                    "apply_at_step": p.apply_at_step,
                    "delta_avg": p.delta_avg.clone(),
                    "local": p.local_delta.clone(),
                }
            )
        return {
            "inner": self.inner.state_dict(),
            "step_count": self.step_count,
            "anchors": [a.clone() for a in self.anchors],
            # This replica's own parameters: between synchronisations replicas differ, and the
            # constructor's broadcast from rank 0 must not erase them on resume.
            "replica": [self._flat(f) for f in range(len(self.fragments))],
            "momenta": [None if m is None else m.clone() for m in self.momenta],
            "pending": pending,
            "exchanges_started": self.exchanges_started,
            "in_sync_at": list(self.in_sync_at),
            "compressor": None if self._compressor is None else self._compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["anchors"]) != len(self.anchors):
            raise ValueError(
                f"checkpoint has {len(state['anchors'])} fragments, this optimizer {len(self.anchors)}"
            )
        self.inner.load_state_dict(state["inner"])
        self.step_count = int(state["step_count"])
        for mine, saved in zip(self.anchors, state["anchors"], strict=True):
            mine.copy_(saved)
        for f, saved in enumerate(state["replica"]):
            self._write(f, saved)
        for f, saved in enumerate(state["momenta"]):
            self.momenta[f] = None if saved is None else saved.clone()
        self._pending = [
            _Pending(
                fragment=p["fragment"],
                sent_at_step=int(p["sent_at_step"]),
                apply_at_step=p["apply_at_step"],
                delta_avg=p["delta_avg"].clone(),
                local_delta=p["local"].clone(),
                handle=None,
            )
            for p in state["pending"]
        ]
        self.exchanges_started = int(state["exchanges_started"])
        # A checkpoint from before the final synchronisation existed: assume every fragment
        # moved (the same on every rank, so the final exchange stays collective).
        self.in_sync_at = list(state.get("in_sync_at", [-1] * len(self.anchors)))
        if self._compressor is not None and state["compressor"] is not None:
            self._compressor.load_state_dict(state["compressor"])

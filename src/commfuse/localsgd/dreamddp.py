"""DreamDDP: local SGD whose synchronisation is spread over the period, a few layers per step,
each exchange overlapped with computation.

Tang et al., "DreamDDP: Accelerating Data Parallel Distributed LLM Training with Layer-wise
Scheduled Partial Synchronization" (arXiv 2502.11058, 2025). Every layer is averaged once per
period of H steps, each at a different iteration, sent while the iteration computes:

1. a layer's value is final once the previous optimizer step wrote it, so as an iteration's
   forward starts a forward pre-hook launches, in the background, one allreduce of every layer
   the iteration averages (concatenated in the order the forward uses them), and it overlaps
   the whole forward and backward pass (the paper launches from the backward pass, which
   leaves the layers the next forward uses first only the optimizer step to hide behind);
2. the optimizer step does not wait: it applies this replica's update ``u`` to the layer as
   sent, ``x - lr u``; the exchange is waited for just before the layer is next used, where
   the layer becomes ``mean(x) - lr u``, the method's update;
3. which layers an iteration averages is a plan (``layer_schedule.py``), chosen from the first
   iterations' profile: the worst iteration's exposed communication is the least, then the
   bytes are spread evenly over the period.

``split=k`` cuts every layer larger than ``1/k`` of a step's mean share into slices, each
planned and sent as a layer of its own (``layer_parts.py``).

Bytes per rank: every layer once per H steps, ``4 N / H`` per step on average (the profile
steps: ``4 N`` each), plus ``32 L`` once for agreeing on the L layers' profiled times and
launch order.

Design notes, and the launches, landings and messages that were tried and measured against
these: ``docs/local-sgd.md``, "DreamDDP: launching, landing, slicing and profiling".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commfuse import collectives
from commfuse.comm import Handle
from commfuse.comm.clock import now
from commfuse.localsgd import layer_parts
from commfuse.localsgd.config import PeriodicSyncConfig
from commfuse.localsgd.layer_schedule import exposed_s, plan_layers
from commfuse.localsgd.optimizer import SyncRecord
from commfuse.localsgd.sync_method import SyncMethod, SyncMethodOptimizer


@dataclass(frozen=True, kw_only=True)
class DreamDDPConfig(SyncMethod):
    """DreamDDP (Tang et al. 2025): every layer averaged once per H steps, a planned group of
    layers per step, sent as one message as the step's forward starts and landed at each
    layer's next use, one iteration later."""

    name = "dreamddp"

    H: int = 8
    """Steps per period: every layer is averaged once in each H steps."""
    profile_steps: int = 1
    """First steps that average every layer and time them (the plan's profile)."""
    max_plan_nodes: int = 200_000
    """Search budget of the plan (exact below it; the best plan found at it)."""
    inner_lr_scale: float = 1.0
    """Multiplies the inner learning rate (as ``PeriodicSyncConfig.inner_lr_scale``)."""
    algo: str = "auto"
    """commfuse allreduce algorithm of the layers' exchanges."""
    final_sync: bool = True
    """Average the replicas at ``finish()`` (the layers' phases differ at any stop)."""
    split: int = 0
    """0: plan whole layers. k >= 1: cut every layer larger than ``1/k`` of a step's mean
    share of the model (its parameters over H) into equal slices no larger, each planned,
    sent and landed as a layer of its own (``layer_parts.py``): the steps then carry nearly
    equal bytes, where whole layers leave the largest layer's step the most."""
    trace: bool = False
    """Keep every exchange's timeline (``DreamDDPOptimizer.trace``: launched, on the wire,
    used, landed) for reading where a step waits; off by default."""

    def __post_init__(self) -> None:
        if self.H < 1:
            raise ValueError(f"H must be >= 1, got {self.H}")
        if self.profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {self.profile_steps}")
        if self.max_plan_nodes < 1:
            raise ValueError(f"max_plan_nodes must be >= 1, got {self.max_plan_nodes}")
        if self.split < 0:
            raise ValueError(f"split must be >= 0 (0: whole layers), got {self.split}")
        self.periodic()

    def periodic(self) -> PeriodicSyncConfig:
        """The shared machinery's config (its final synchronisation and checkpoint)."""
        return PeriodicSyncConfig(
            H=self.H,
            inner_lr_scale=self.inner_lr_scale,
            algo=self.algo,
            final_sync=self.final_sync,
        )


def layers_of(module: nn.Module, params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The layers: each submodule's own trainable parameters (indices into ``params``), in
    registration order; a parameter shared by two modules belongs to the first."""
    return [members for _, members in _owned_layers(module, params)]


def _owned_layers(
    module: nn.Module, params: Sequence[torch.Tensor]
) -> list[tuple[nn.Module, list[int]]]:
    """``layers_of``'s layers, each with the submodule that owns it."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    layers = []
    for sub in module.modules():
        own = [index[id(p)] for p in sub.parameters(recurse=False) if id(p) in index]
        own = [i for i in own if i not in seen]
        seen.update(own)
        if own:
            layers.append((sub, own))
    return layers


@dataclass(kw_only=True)
class _Launched:
    layer: int
    step: int
    """The step (1-based) whose backward pass launched it."""
    sent: torch.Tensor
    """The layer's parameters as sent (for the drift, and the correction at landing)."""
    average: torch.Tensor
    handle: Handle | None
    land_step: int = 0
    """The step (1-based) whose use of the layer lands it (the one after ``step``)."""
    times: dict[str, float] | None = None
    """With ``trace``: its message's launch and time on the wire (``DreamDDPOptimizer.trace``),
    shared by the layers sent together."""


class DreamDDPOptimizer(SyncMethodOptimizer[DreamDDPConfig]):
    """DreamDDP's optimizer (the module docstring). Installs a forward pre-hook on the model
    (the iteration's launches), a post-accumulate-grad hook on every parameter (the profile's
    launches) and a forward pre-hook on every layer's module (its
    landing); ``plan[l]`` is the
    iteration of the period that averages layer l (None until the profile is done); ``syncs``
    has one record per layer exchange (its ``fragment`` is the layer), made when it lands."""

    def _start(self) -> None:
        owned = _owned_layers(self.module, self.params)
        self.layers = [members for _, members in owned]
        self.layer_of = {
            id(self.params[i]): layer for layer, members in enumerate(self.layers) for i in members
        }
        numels = [p.numel() for p in self.params]
        self.parts = layer_parts.cut_layers(self.layers, numels, self.method.H, self.method.split)
        """The units planned, sent and landed (``layer_parts.py``): the layers, or their slices
        with ``split``; every index below that says layer means a part (one per layer without
        ``split``)."""
        self.parts_of: list[list[int]] = [[] for _ in self.layers]
        for index, part in enumerate(self.parts):
            self.parts_of[part.layer].append(index)
        self.plan: list[int] | None = None
        """Per part, the iteration of the period that averages it (None before the profile)."""
        self.backward_order: list[int] = []
        """Layers in the order the profiled backward pass finished them."""
        self.launch_order: list[int] = []
        """Layers in the order an iteration launches them (the plan's order): the order the
        profiled forward used them."""
        self.communicate = True
        """False: hooks launch nothing and ``step()`` is the inner step (compute-only timing)."""
        self.hook_launches = 0
        """Exchanges launched from the forward's hooks (the others: the profile steps', and
        from ``step()``, for a due layer no hook launched)."""
        self._remaining = [len(members) for members in self.layers]
        self._launched: list[_Launched] = []
        """This iteration's exchanges (launched since the last step)."""
        self._in_flight: dict[int, _Launched] = {}
        """Exchanges of past iterations not landed yet, by layer (landed at the layer's use)."""
        self._forward_started: float | None = None
        self._ready_at: dict[int, float] = {}
        self._comm_s: dict[int, float] = {}
        self._used_at: dict[int, float] = {}
        self._inner_s = 0.0
        self._until_step_s = 0.0
        """Profiled compute from the forward's start to the backward pass's last layer."""
        self._paused_s = 0.0
        self.wait_s: list[float] = []
        """Per step (communicating, after the profile), the seconds spent waiting for exchanges
        since the previous step: in the forward's pre-hooks, then in ``step()``."""
        self._waited = 0.0
        self.trace: list[dict[str, float]] = []
        """With ``DreamDDPConfig.trace``: one entry per exchange after the profile, once landed:
        ``layer``, ``step`` (launched), ``landed_step``, ``bytes`` and, in seconds from the optimizer's creation,
        ``launched`` (handed to the worker thread), ``wire_start`` and ``wire_end`` (the
        worker thread ran its collective), ``used`` (its layer's pre-hook asked for it) and
        ``landed`` (the wait returned); ``forward_s`` and ``step_s`` hold, per step, when its
        forward started and when its ``step()`` was called."""
        self.forward_s: list[float] = []
        self.step_s: list[float] = []
        self.trace_origin_s = now(self.params[0].device)
        """The trace's origin on ``now``'s clock (one clock for every rank of one machine)."""
        self.profile: dict[str, list[float]] = {}
        """The agreed profile: per layer in launch order, ``backward_s`` (the compute before its
        launch, after the previous layer's), ``comm_s`` and ``slack_s`` (the compute from the
        last launch to its use: ``layer_schedule.py``)."""
        # The model's own hook first: a root module that owns a layer lands it after.
        self._hooks = [self.module.register_forward_pre_hook(self._forward_begins)]
        self._hooks += [
            p.register_post_accumulate_grad_hook(self._grad_ready)  # type: ignore[no-untyped-call]
            for p in self.params
        ]
        self._hooks += [
            sub.register_forward_pre_hook(functools.partial(self._before_use, layer))
            for layer, (sub, _) in enumerate(owned)
        ]

    # -- which layers this iteration averages ------------------------------------------------
    @property
    def profiling(self) -> bool:
        """Whether the coming step is a profile step (every layer, timed)."""
        return self.step_count < self.method.profile_steps

    def due(self, layer: int) -> bool:
        """Whether the coming step (``step_count + 1``) averages ``layer``."""
        if self.profiling or self.plan is None:
            return True
        iteration = (self.step_count - self.method.profile_steps) % self.method.H
        return self.plan[layer] == iteration

    # -- hooks ---------------------------------------------------------------------------------
    def _launches_from_forward(self) -> bool:
        """Whether this forward launches the iteration's exchanges (a training forward after
        the profile)."""
        return (
            self.communicate
            and not self.profiling
            and self.plan is not None
            and torch.is_grad_enabled()
        )

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        """The model's forward pre-hook: in a profile step, the forward's start; after it, the
        launch of every due layer (step 1 of the module docstring) but those whose previous
        exchange is still in flight (H = 1: launched once it lands, at their use)."""
        del module, args
        if self.profiling and self._forward_started is None:
            self._forward_started = now(self.params[0].device)
        if self.method.trace and self.communicate and torch.is_grad_enabled():
            self.forward_s.append(self._clock())
        if not self._launches_from_forward():
            return
        launched = {item.layer for item in self._launched}
        due = [
            layer
            for layer in self.launch_order
            if self.due(layer) and layer not in launched and layer not in self._in_flight
        ]
        self.hook_launches += len(due)
        self._send(due)

    def _before_use(self, layer: int, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: land the layer's exchange in flight (and, at H = 1, launch the
        next); in a profile step, time the layer's use from the forward's first."""
        del module, args
        if self.profiling:
            t = now(self.params[0].device)
            if self._forward_started is None:
                self._forward_started = t
            for part in self.parts_of[layer]:
                self._used_at.setdefault(part, t - self._forward_started)
        for part in self.parts_of[layer]:
            pending = self._in_flight.get(part)
            if pending is not None and pending.land_step <= self.step_count + 1:
                del self._in_flight[part]
                self._land(pending)
                if self._launches_from_forward() and self.due(part):
                    self.hook_launches += 1
                    self._launch(part)

    def _grad_ready(self, param: torch.Tensor) -> None:
        layer = self.layer_of[id(param)]
        self._remaining[layer] -= 1
        if self._remaining[layer] > 0:
            return
        # Counted afresh for the next backward pass, whether or not a step follows this one.
        self._remaining[layer] = len(self.layers[layer])
        if not self.communicate or not self.profiling:
            return
        for part in self.parts_of[layer]:
            launched = any(item.layer == part for item in self._launched)
            if not launched and self.due(part):
                self._launch(part)

    def _launch(self, layer: int) -> None:
        """Launch ``layer``'s exchange alone: in the background (``_send``), or in a profile
        step timed, the caller waiting."""
        if not self.profiling:
            self._send([layer])
            return
        sent = layer_parts.read(self.params, self.parts[layer])
        average = sent.clone()
        step = self.step_count + 1
        # Profile: the exchange runs alone, timed, and the backward pass waits for it (the
        # time it waits is taken out of the next layer's backward time).
        device = sent.device
        ready = now(device)
        self._ready_at[layer] = ready - self._paused_s
        collectives.all_reduce(self.outer_comm, average, "avg", algo=self.config.algo)
        spent = now(device) - ready
        self._comm_s[layer] = spent
        self._paused_s += spent
        self._launched.append(
            _Launched(layer=layer, step=step, sent=sent, average=average, handle=None)
        )

    def _clock(self) -> float:
        """Seconds since the optimizer's creation (the trace's clock)."""
        return now(self.params[0].device) - self.trace_origin_s

    def _send(self, layers: list[int]) -> None:
        """Launch the exchange of ``layers`` in the background as one message (their
        parameters concatenated), each layer's part landed on its own (``_land``)."""
        if not layers:
            return
        for layer in layers:
            pending = self._in_flight.pop(layer, None)
            if pending is not None:  # its module's pre-hook did not fire (H = 1)
                self._land(pending)
        sent = torch.cat([layer_parts.read(self.params, self.parts[layer]) for layer in layers])
        average = sent.clone()
        times = {"launched": self._clock()} if self.method.trace else None
        handle: Handle | None
        if times is not None:
            handle = self._traced_all_reduce(average, times)
        else:
            handle = collectives.all_reduce(
                self.outer_comm, average, "avg", algo=self.config.algo, async_op=True
            )
        step, offset = self.step_count + 1, 0
        for layer in layers:
            numel = self.parts[layer].numel
            part = slice(offset, offset + numel)
            offset += numel
            self._launched.append(
                _Launched(
                    layer=layer,
                    step=step,
                    sent=sent[part],
                    average=average[part],
                    handle=handle,
                    land_step=step + 1,
                    times=times,
                )
            )

    def _traced_all_reduce(self, average: torch.Tensor, times: dict[str, float]) -> Handle:
        """The exchange of ``average`` as one job on the worker thread that stamps in ``times``
        when the thread starts and ends its collective (the synchronous form run there is the
        same algorithm the asynchronous form would queue)."""

        def job() -> None:
            times["wire_start"] = self._clock()
            collectives.all_reduce(self.outer_comm, average, "avg", algo=self.config.algo)
            times["wire_end"] = self._clock()

        return self.outer_comm.submit("all_reduce.dreamddp", job)

    # -- the step ------------------------------------------------------------------------------
    def _step(self) -> None:
        """Launch any due layer whose hook did not fire, take the inner step (a profile step
        lands its exchanges first), keep this iteration's exchanges in flight until their
        layers' next use, and after the profile plan the period."""
        if not self.communicate:
            self.inner.step()
            return
        if self.method.trace:
            self.step_s.append(self._clock())
        # Exchanges due to land whose layers were not used (a module called around its hook).
        for pending in list(self._in_flight.values()):
            if pending.land_step <= self.step_count + 1:
                del self._in_flight[pending.layer]
                self._land(pending)
        done = {launched.layer for launched in self._launched}
        for layer in self.launch_order or range(len(self.parts)):
            if layer not in done and self.due(layer):
                self._launch(layer)  # no hook launched it: sent from here, in launch order
        profiling = self.profiling
        if profiling:
            for launched in self._launched:
                self._wait(launched)
                self._write_layer(launched.layer, launched.average)
                self._record(launched)
        else:
            self._in_flight.update({launched.layer: launched for launched in self._launched})
        if profiling:
            self._record_profile()
        self._launched = []
        started = now(self.params[0].device)
        self._inner_step(self.config.inner_lr_scale)
        if profiling:
            self._inner_s = now(self.params[0].device) - started
        if not profiling:
            self.wait_s.append(self._waited)
        self._waited = 0.0
        self.step_count += 1
        self._forward_started = None
        if profiling and not self.profiling:
            self._make_plan()

    def _wait(self, launched: _Launched) -> None:
        """Wait for an exchange, the time counted in ``wait_s``."""
        if launched.handle is not None:
            started = now(self.params[0].device)
            launched.handle.wait()
            launched.handle = None
            self._waited += now(self.params[0].device) - started

    def _land(self, launched: _Launched) -> None:
        """Wait for an exchange and move the layer by the average's difference from what was
        sent (the local step taken since stays on it)."""
        used = self._clock()
        self._wait(launched)
        if launched.times is not None:
            self.trace.append(
                {
                    "layer": launched.layer,
                    "step": launched.step,
                    "landed_step": self.step_count + 1,
                    "bytes": launched.average.numel() * launched.average.element_size(),
                    **launched.times,
                    "used": used,
                    "landed": self._clock(),
                }
            )
        layer_parts.add(self.params, self.parts[launched.layer], launched.average - launched.sent)
        self._record(launched)

    def _record(self, launched: _Launched) -> None:
        drift = float((launched.sent - launched.average).norm())
        scale = float(launched.sent.norm()) or 1.0
        self.syncs.append(
            SyncRecord(
                step=launched.step,
                fragment=launched.layer,
                numel=launched.average.numel(),
                drift=drift,
                relative_drift=drift / scale,
            )
        )

    def land_in_flight(self) -> None:
        """Wait for and apply every exchange in flight (``finish()``'s first half), then the
        shared machinery's."""
        for pending in self._in_flight.values():
            self._land(pending)
        self._in_flight.clear()
        super().land_in_flight()

    def _write_layer(self, layer: int, flat: torch.Tensor) -> None:
        layer_parts.write(self.params, self.parts[layer], flat)

    def _record_profile(self) -> None:
        order = sorted(self._ready_at, key=lambda layer: self._ready_at[layer])
        if len(order) == len(self.parts):
            self.backward_order = order
        if self._forward_started is not None and self._ready_at:
            # ``_ready_at`` leaves out the exchanges' pauses; the forward had none.
            self._until_step_s = max(0.0, max(self._ready_at.values()) - self._forward_started)
        self._paused_s = 0.0

    def _own_launch_order(self) -> list[int]:
        """This rank's launch order: the profiled forward's order of use (the layers whose
        module's pre-hook did not fire last, in backward order), or the backward order."""
        backward = self.backward_order or list(reversed(range(len(self.parts))))
        used = sorted(self._used_at, key=lambda layer: self._used_at[layer])
        return used + [layer for layer in backward if layer not in self._used_at]

    def _plan_times(self, order: list[int]) -> tuple[list[float], list[float]]:
        """This rank's profile in the plan's terms (``layer_schedule.py``), per layer in
        ``order``: the compute before its launch, after the previous layer's (none: every layer
        is launched as the forward starts), and the compute from the launch to its use: the
        iteration, then the next forward up to the layer (the optimizer step where no
        pre-hook fired for it)."""
        until = self._until_step_s
        used = self._used_at
        return [0.0] * len(order), [
            until + self._inner_s + used[layer] if layer in used else until for layer in order
        ]

    def _make_plan(self) -> None:
        """Agree on the launch order (rank 0's) and the profiled times (the slowest rank's: a
        max, exact on every rank), then plan every layer's iteration from them, identically on
        every rank."""
        layers = len(self.parts)
        device = self.params[0].device
        order_t = torch.tensor(self._own_launch_order(), dtype=torch.int64, device=device)
        if self.outer_comm.world_size > 1:
            collectives.broadcast(self.outer_comm, order_t, 0, algo="native")
        order = [int(x) for x in order_t.tolist()]
        backward, slack = self._plan_times(order)
        # One max-reduction agrees on all three: the slowest rank's compute and exchange times
        # (the pessimistic ones), and the least slack (its negation's max), for the same reason.
        times = torch.tensor(
            [*backward, *[self._comm_s.get(layer, 0.0) for layer in order], *[-x for x in slack]],
            dtype=torch.float64,
            device=device,
        )
        if self.outer_comm.world_size > 1:
            collectives.all_reduce(self.outer_comm, times, "max", algo="native")
            self.control_bytes += times.numel() * 8 + order_t.numel() * 8
        self.launch_order = order
        values = times.tolist()
        backward_s, comm_s = values[:layers], values[layers : 2 * layers]
        slack_s = [-x for x in values[2 * layers :]]
        # Slices are balanced by their bytes: each was timed alone, with a message's fixed
        # cost that an iteration's one message pays once (``plan_layers``'s ``load``).
        load = [float(self.parts[part].numel) for part in order] if self.method.split else None
        plan_in_order = plan_layers(
            backward_s,
            comm_s,
            self.method.H,
            slack_s,
            max_nodes=self.method.max_plan_nodes,
            load=load,
            fused=True,
        )
        plan = [0] * layers
        for position, layer in enumerate(order):
            plan[layer] = plan_in_order[position]
        self.plan = plan
        self.profile = {"backward_s": backward_s, "comm_s": comm_s, "slack_s": slack_s}

    def planned_iterations(self) -> list[dict[str, float]]:
        """Per iteration of the period, what the plan expects from the profile it was made
        from: ``comm_s``, its layers' exchange times added up, and ``exposed_s``, how long the
        iteration stalls waiting for them (``layer_schedule.py``); empty before the plan and
        after a resume (the profile is not checkpointed, the plan is)."""
        if self.plan is None or not self.profile:
            return []
        backward, comm = self.profile["backward_s"], self.profile["comm_s"]
        slack = self.profile.get("slack_s")
        out = []
        for it in range(self.method.H):
            positions = [i for i, layer in enumerate(self.launch_order) if self.plan[layer] == it]
            out.append(
                {
                    "comm_s": sum(comm[i] for i in positions),
                    "exposed_s": exposed_s(positions, backward, comm, slack, fused=True),
                }
            )
        return out

    # -- the rest of the optimizer interface ---------------------------------------------------
    def close(self) -> None:
        """Remove the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def state_dict(self) -> dict[str, Any]:
        """The shared state, the plan (the profile's times differ from run to run, so a resumed
        run must keep the plan it had), and the exchanges in flight, waited for but not landed:
        the resumed run lands them where this one does, at their layers' next use."""
        state = super().state_dict()
        in_flight = []
        for pending in self._in_flight.values():
            if pending.handle is not None:
                pending.handle.wait()
                pending.handle = None
            in_flight.append(
                {
                    "layer": pending.layer,
                    "step": pending.step,
                    "land_step": pending.land_step,
                    "sent": pending.sent.clone(),
                    "average": pending.average.clone(),
                }
            )
        state["dreamddp"] = {
            "plan": None if self.plan is None else list(self.plan),
            "launch_order": list(self.launch_order),
            "control_bytes": self.control_bytes,
            "in_flight": in_flight,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state["dreamddp"]
        self.plan = None if own["plan"] is None else [int(x) for x in own["plan"]]
        self.launch_order = [int(x) for x in own.get("launch_order", own.get("backward_order", []))]
        self.control_bytes = int(own["control_bytes"])
        device = self.params[0].device
        self._in_flight = {
            int(item["layer"]): _Launched(
                layer=int(item["layer"]),
                step=int(item["step"]),
                land_step=int(item.get("land_step", int(item["step"]) + 1)),
                sent=item["sent"].to(device),
                average=item["average"].to(device),
                handle=None,
            )
            for item in own.get("in_flight", [])
        }


DreamDDPConfig.optimizer_class = DreamDDPOptimizer

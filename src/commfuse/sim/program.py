"""One training step as a graph of tasks on each rank's streams.

Every rank has three streams, as a PyTorch job on a GPU does: ``compute`` (forward, backward,
optimizer), ``mp`` (the collectives layers need for their own activations: tensor-parallel
allreduces, embedding and expert All-to-Alls) and ``dp`` (gradient buckets, outer updates).
A task starts when its stream's previous task and its dependencies are done. The step:

1. forward, layer by layer; a layer with a collective waits for it before the next layer starts,
   unless it is fused: then its compute runs in ``fused_chunks`` chunks and each chunk's
   collective runs while the next chunk computes (the next layer still waits for the last);
2. backward in reverse, the same way; each data-parallel layer's gradient joins the current
   bucket, and a full bucket's allreduce is issued on ``dp`` (right away with overlap, after the
   last backward task without);
3. the optimizer, after every bucket; with local SGD every ``local_sgd_period``-th step ends with
   one allreduce of the parameters (``outer``), between the memory-bound work that forms the
   delta and applies the outer step (``OUTER_*_BYTES_PER_PARAM_BYTE``).

Compute tasks last per rank (stragglers are slower); a collective starts when the last of its
ranks is ready, since it cannot complete before every rank has joined.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from commfuse.sim.cluster import ClusterModel
from commfuse.sim.model import Layer, LayerComm, ModelProfile
from commfuse.sim.network import Demand, Group, demand, profile_of
from commfuse.sim.plan import CommPlan

#: The stream a task runs on, in order with the stream's other tasks: each rank's compute, its
#: model-parallel collectives (tensor-parallel, All-to-All) and its data-parallel ones.
Stream = Literal["compute", "mp", "dp"]
#: What a task counts as in the step's breakdown (``delay``: a straggler's late start; ``outer``:
#: local SGD's exchange of the parameters).
Category = Literal["compute", "delay", "mp", "dp", "outer"]


@dataclasses.dataclass(kw_only=True)
class Task:
    """One piece of work on one stream of every rank: a compute task (``compute_s``) or a
    collective (``demand``). The step's builder appends each task's predecessor on its stream to
    ``deps`` as it adds it."""

    name: str
    """Its label in the breakdown and the Chrome trace."""
    stream: Stream
    """Where it runs (``Stream``)."""
    category: Category
    """What it counts as (``Category``)."""
    deps: list[int]
    """Indices of the tasks it waits for."""
    compute_s: np.ndarray | None = None
    """Per-rank duration of a compute task, seconds."""
    demand: Demand | None = None
    """A collective's network demand."""
    overhead_s: float = 0.0
    """Extra time before a collective's bytes move (compression), seconds."""
    nbytes: int = 0
    """A collective's message, bytes (what ``ClusterModel.comm_cpu_us_per_mbyte`` charges)."""


def groups(cluster: ClusterModel, tp: int) -> dict[str, Group]:
    """The shapes of the tp, dp and world groups for ``tp`` ranks per tensor-parallel group."""
    world, local = cluster.world_size, cluster.ranks_per_host
    if world % tp or (local % tp and tp % local):
        raise ValueError(
            f"tp_size {tp} must divide the world ({world} ranks) and either divide or be a "
            f"multiple of ranks_per_host ({local})"
        )
    if tp <= local:
        tp_group = Group(
            size=tp, ranks_per_host=tp, groups_per_host=local // tp, num_groups=world // tp
        )
        dp_group = Group(
            size=world // tp, ranks_per_host=local // tp, groups_per_host=tp, num_groups=tp
        )
    else:
        tp_group = Group(size=tp, ranks_per_host=local, num_groups=world // tp)
        dp_group = Group(size=world // tp, ranks_per_host=1, groups_per_host=local, num_groups=tp)
    return {
        "tp": tp_group,
        "dp": dp_group,
        "world": Group(size=world, ranks_per_host=local),
    }


class _Builder:
    def __init__(self, cluster: ClusterModel, workload: ModelProfile, plan: CommPlan) -> None:
        self.cluster, self.workload, self.plan = cluster, workload, plan
        self.tasks: list[Task] = []
        self.last: dict[str, int] = {}
        self.profile = profile_of(cluster)
        self.groups = groups(cluster, workload.tp_size)
        slow = np.ones(cluster.world_size)
        for s in cluster.stragglers:
            slow[s.rank] = s.slowdown
        self.slowdown = slow

    def add(self, task: Task) -> int:
        if task.stream in self.last:
            task.deps.append(self.last[task.stream])
        self.tasks.append(task)
        self.last[task.stream] = len(self.tasks) - 1
        return len(self.tasks) - 1

    def compute(self, name: str, flops: float, mem_bytes: float, deps: list[int]) -> int:
        c = self.cluster
        seconds = max(flops / c.flops_per_s, mem_bytes / (c.mem_gbyte_per_s * 1e9))
        return self.add(
            Task(
                name=name,
                stream="compute",
                category="compute",
                deps=deps,
                compute_s=seconds * self.slowdown,
            )
        )

    def comm(
        self,
        name: str,
        collective: str,
        nbytes: int,
        group: str,
        stream: Literal["mp", "dp"],
        deps: list[int],
        *,
        overhead_s: float = 0.0,
        category: Category | None = None,
    ) -> int:
        algo = self.plan.algorithm_for(collective)
        need = demand(collective, algo, nbytes, self.groups[group], self.cluster, self.profile)
        return self.add(
            Task(
                name=name,
                stream=stream,
                category=stream if category is None else category,
                deps=deps,
                demand=need,
                overhead_s=overhead_s,
                nbytes=nbytes,
            )
        )

    def layer(self, layer: Layer, phase: str, flops: float, deps: list[int]) -> int:
        """A layer's compute and its own collectives; the index of what the next layer waits on."""
        comms = [c for c in layer.comms if c.phase == phase]
        if not comms:
            return self.compute(f"{phase} {layer.name}", flops, layer.mem_bytes, deps)
        chunks = self.plan.fused_chunks if all(c.fusable for c in comms) else 1
        parts = len(comms) * chunks
        last = -1
        for comm in comms:
            for k in range(chunks):
                label = f"{phase} {layer.name}" + (f" [{k + 1}/{chunks}]" if chunks > 1 else "")
                done = self.compute(label, flops / parts, layer.mem_bytes / parts, deps)
                deps = []
                last = self._layer_comm(comm, label, chunks, done)
            if chunks == 1 or comm is not comms[-1]:
                deps = [last]  # unfused (or the next collective's input): wait for it
        return last

    def _layer_comm(self, comm: LayerComm, label: str, chunks: int, after: int) -> int:
        size = -(-comm.nbytes // chunks)
        index = self.comm(
            f"{comm.collective} {label}", comm.collective, size, comm.group, "mp", [after]
        )
        if comm.collective == "all_to_all" and chunks > 1:
            # A fused All-to-All sends each chunk to a subset of the peers as soon as it is
            # computed (SC24): the P - 1 messages are split among the chunks, not repeated.
            need = self.tasks[index].demand
            assert need is not None
            self.tasks[index].demand = Demand(latency_s=need.latency_s / chunks, busy_s=need.busy_s)
        return index


def build_step(
    cluster: ClusterModel, workload: ModelProfile, plan: CommPlan, *, sync: bool = True
) -> list[Task]:
    """The task graph of one step. ``sync`` (with local SGD): whether this step synchronises."""
    need = workload.memory_bytes()
    if need > cluster.memory_gbyte * 1e9:
        raise ValueError(
            f"workload {workload.name!r} needs {need / 1e9:.1f} GB per rank (model state and "
            f"activations), more than the cluster's {cluster.memory_gbyte:g} GB; shard it "
            "(tensor parallelism), shrink the batch, or pick a cluster with more memory"
        )
    b = _Builder(cluster, workload, plan)
    s = plan
    delay = np.zeros(cluster.world_size)
    for st in cluster.stragglers:
        delay[st.rank] = st.delay_us * 1e-6
    start = b.add(
        Task(name="start delay", stream="compute", category="delay", deps=[], compute_s=delay)
    )
    previous = start
    for layer in workload.layers:
        previous = b.layer(layer, "fwd", layer.fwd_flops, [previous])
    local_sgd = s.local_sgd_period > 1
    bucket: list[Layer] = []
    pending: list[tuple[list[Layer], int]] = []
    dp_tasks: list[int] = []

    def flush(after: int) -> None:
        if bucket:
            pending.append((list(bucket), after))
            bucket.clear()

    for layer in reversed(workload.layers):
        previous = b.layer(layer, "bwd", layer.bwd_flops, [previous])
        if layer.data_parallel and layer.param_bytes and not local_sgd:
            bucket.append(layer)
            if sum(x.param_bytes for x in bucket) >= s.cap_of_bucket(len(pending) + len(dp_tasks)):
                flush(previous)
                if s.overlap:
                    dp_tasks.append(_bucket(b, *pending.pop()))
    flush(previous)
    for layers, after in pending:
        dp_tasks.append(_bucket(b, layers, after if s.overlap else previous))
    optimizer_bytes = workload.param_bytes * workload.state_bytes_per_param_byte
    done = b.compute("optimizer", 0.0, optimizer_bytes, [previous, *dp_tasks])
    if local_sgd and sync and workload.dp_param_bytes:
        params = int(workload.dp_param_bytes * s.outer_fraction)
        prepare = b.compute(
            "outer delta", 0.0, _OUTER_PREPARE_BYTES_PER_PARAM_BYTE * params, [done]
        )
        collective, size = s.message(params, workload.param_dtype_bytes, b.groups["dp"].size)
        exchange = b.comm(
            f"outer {collective}",
            collective,
            size,
            "dp",
            "dp",
            [prepare],
            overhead_s=_compress_s(b, params),
            category="outer",
        )
        b.compute("outer step", 0.0, _OUTER_APPLY_BYTES_PER_PARAM_BYTE * params, [exchange])
    return b.tasks


#: Memory traffic of a synchronisation of ``localsgd.PeriodicSyncOptimizer``, bytes moved per
#: parameter byte, counted from the code: flatten the parameters (read, write), ``anchor -
#: flat`` (2 reads, 1 write), keep a copy of this rank's delta (2) ...
_OUTER_PREPARE_BYTES_PER_PARAM_BYTE = 7.0
#: ... then divide the sum (2), the drift ``norm(local - avg)`` (3 + 1) and the anchor's norm
#: (1), the outer SGD step on the anchor (3), the anchor written back into the parameters (2).
_OUTER_APPLY_BYTES_PER_PARAM_BYTE = 12.0


def _compress_s(b: _Builder, nbytes: int) -> float:
    s = b.plan
    if not s.compresses or s.compression_gbyte_per_s == 0:
        return 0.0
    return nbytes / (s.compression_gbyte_per_s * 1e9)


#: Parameter tensors per layer in the NaN/Inf agreement message (a weight and a bias).
_TENSORS_PER_LAYER = 2


def _bucket(b: _Builder, layers: list[Layer], after: int) -> int:
    nbytes = sum(x.param_bytes for x in layers)
    dp_size = b.groups["dp"].size
    collective, size = b.plan.message(nbytes, b.workload.param_dtype_bytes, dp_size)
    name = f"{collective} bucket {layers[0].name}..{layers[-1].name}"
    if b.plan.compresses and b.plan.finite_agreement:
        # commfuse.ddp agrees on NaN/Inf before a compressor touches its error feedback: one
        # max-allreduce of an fp32 flag per tensor per bucket, latency-bound.
        table = 4 * _TENSORS_PER_LAYER * len(layers)
        after = b.comm(f"agree finite {name}", "all_reduce", table, "dp", "dp", [after])
    return b.comm(name, collective, size, "dp", "dp", [after], overhead_s=_compress_s(b, nbytes))

"""The one transport every commfuse algorithm uses: a process group plus accounting and deadlines.

``Communicator`` wraps a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU) and
offers point-to-point send/receive (blocking and asynchronous), the backend's native
collectives, and sub-groups (one per host, one across hosts). Around every operation it

* counts messages and bytes per rank and per operation kind (``stats``), exactly for
  point-to-point traffic, which is what the algorithms of layer 2 are built from;
* optionally records a trace (``trace``) that exports as Chrome trace JSON;
* waits with a deadline and names rank, operation, peer and step when it expires.

Ranks given to and returned by a Communicator are ranks *within its group*; ``global_rank``
translates. The group is passed in explicitly (no global singleton), so a sub-group's
communicator is used exactly like the world's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist

from commfuse.cluster.failures import root_store
from commfuse.cluster.rank_runtime import comm_settings
from commfuse.comm import registry
from commfuse.comm.errors import InconsistentInputError
from commfuse.comm.handle import FailureBoard, Handle, OpContext, translate_failure
from commfuse.comm.interpreter_exit import guard_interpreter_exit
from commfuse.comm.stats import CommStats
from commfuse.comm.trace import Trace, TraceEvent, now_us
from commfuse.comm.watch import gloo_stopper
from commfuse.comm.worker import Worker, on_worker_thread

S = TypeVar("S")

# torch 2.13 renamed the tensor forms (the old names warn); older releases only have the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: Reduction names accepted everywhere in commfuse.
_REDUCE_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
ReduceOpName = Literal["sum", "avg", "prod", "max", "min"]
"""A reduction's name, as torch spells it (``avg`` is the sum divided by the world size)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How a Communicator behaves, and what it knows of the cluster it runs on.

    A Communicator built without one gets ``default_config()``: in a rank started by
    ``commfuse launch``/``run``, torchrun or the test pool, the fields its launcher's
    environment sets (``COMMFUSE_DEADLINE_S``, ``COMMFUSE_LINK_MBIT``, ``LOCAL_WORLD_SIZE``,
    ``COMMFUSE_TUNER_PROFILE``, ``COMMFUSE_TUNER_TRIAL_CALLS``), read once per process by the
    rank's start-up (``commfuse.cluster.rank_runtime.comm_settings``); nothing else in the
    library reads the environment.

    Raises:
        ValueError: a deadline that is not positive, a link rate that is not positive, or
            ``ranks_per_host`` or ``wait_thread_min_bytes`` that is not an integer of at least 1
            (the message names the field).

    Example:
        ```python
        comm = Communicator(config=CommConfig(deadline_s=30, validate=True))
        ```
    """

    deadline_s: float = 60.0
    """Seconds any wait may block before raising CommTimeoutError."""
    trace: bool = False
    """Record every operation for a Chrome trace (small cost per operation)."""
    validate: bool = False
    """Before each collective, check that all ranks pass the same shape and dtype (costs one
    tiny all-gather; turn on while developing, off for speed)."""
    link_mbit: float | None = None
    """Rate of the links between hosts in Mbit/s, the same on every rank; None when unknown
    (unshaped). The tuner's default profile and the pipelines' default block size model it."""
    ranks_per_host: int | None = None
    """Ranks on each host (ranks are host-major); None when unknown: hierarchical algorithms
    then run flat and the tuner's default profile assumes one host."""
    tuner_profile_path: str | None = None
    """A profile saved by ``commfuse tune``, for ``algo="auto"``; None: the default profile
    built from ``link_mbit`` and ``ranks_per_host``. With ``tuner_trial_calls`` on, the trials'
    decisions are saved in it too (the file is created when missing)."""
    tuner_trial_calls: int = 0
    """Timed calls per candidate when ``algo="auto"`` first meets a (collective, size): the
    first calls then try native and the model's two fastest other algorithms on the caller's
    own messages and keep the fastest (``collectives/trial.py``); 0: the model alone decides."""
    wait_thread_min_bytes: int | None = 1 << 20
    """Point-to-point messages of at least this many bytes are waited for on a waiting thread
    (``comm/waiters.py``) while the caller reads the job's failure notice: gloo cannot wake a
    wait whose message it was moving when the peer died, and the caller then raises
    ``PeerFailureError`` at once instead of at the deadline. None: every wait blocks the
    caller's thread (the watch thread names such a wait on stderr). Handing a wait over costs
    tens of microseconds, little beside a megabyte on the wire."""

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"CommConfig.deadline_s must be > 0 seconds, got {self.deadline_s!r}")
        if self.link_mbit is not None and not self.link_mbit > 0:
            raise ValueError(f"CommConfig.link_mbit must be > 0 or None, got {self.link_mbit!r}")
        _require_int("tuner_trial_calls", self.tuner_trial_calls, least=0)
        _require_int("wait_thread_min_bytes", self.wait_thread_min_bytes, least=1, none=True)
        _require_int("ranks_per_host", self.ranks_per_host, least=1, none=True)


def _require_int(name: str, value: object, *, least: int, none: bool = False) -> None:
    """Raise ValueError naming ``CommConfig.name`` unless ``value`` is an int (not a bool) of at
    least ``least``, or None where ``none`` allows it."""
    if none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        allowed = f"an int >= {least}" + (" or None" if none else "")
        raise ValueError(f"CommConfig.{name} must be {allowed}, got {value!r}")


def default_config() -> CommConfig:
    """The config of a Communicator built without one: ``CommConfig()`` with the fields the
    rank's start-up read from its environment (``rank_runtime.CommSettings``)."""
    settings = dataclasses.asdict(comm_settings())
    return CommConfig(**{key: value for key, value in settings.items() if value is not None})


def _failure_board(comm: Communicator) -> FailureBoard | None:
    """The job's failure notice, read through the default process group's store (the one every
    rank of the job shares, whatever started it); None when that store is not reachable."""
    try:
        store = root_store(dist.distributed_c10d._get_default_store())
    except (AttributeError, RuntimeError, ValueError):
        return None
    members = frozenset(comm.global_rank(r) for r in range(comm.world_size))
    return FailureBoard(
        store,
        rank=comm.global_rank_of_self,
        world_rank_of=comm.global_rank,
        members=members,
        stop_group=gloo_stopper(comm.group, comm.device) if comm.backend == "gloo" else None,
    )


def nbytes_of(tensor: torch.Tensor) -> int:
    """The bytes a tensor's elements take: what a collective that sends it counts."""
    return tensor.numel() * tensor.element_size()


class Communicator:
    """A process group with accounting, tracing and deadlines. See the module docstring.

    Args:
        group: the process group to wrap; None: the default (world) group.
        config: deadlines, tracing, validation and what the tuner knows of the cluster; None:
            ``default_config()``, what the rank's launcher set.
        name: shown in error messages and traces (``"world"``, ``"host"``, ...).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised yet (``commfuse.cluster.run``
            initialises it; a script under ``commfuse launch`` or torchrun calls
            ``dist.init_process_group("gloo")`` itself: the launcher sets only the variables
            it reads).

    Example:
        ```python
        dist.init_process_group("gloo")
        comm = Communicator(config=CommConfig(deadline_s=30, trace=True))
        comm.all_reduce(grad, "avg")
        print(comm.stats.total().bytes_sent)
        comm.trace.export_chrome(f"trace-rank{comm.rank}.json")  # open in ui.perfetto.dev
        ```
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        config: CommConfig | None = None,
        name: str = "world",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Communicator needs torch.distributed initialised first: call "
                'torch.distributed.init_process_group("gloo") (or "nccl" on GPUs) at the start '
                "of the script; commfuse launch and torchrun set only the variables it reads "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
            )
        self.group: dist.ProcessGroup = group if group is not None else dist.group.WORLD  # type: ignore[assignment]
        self.config = config or default_config()
        self.name = name
        self.rank: int = dist.get_rank(self.group)
        self.world_size: int = dist.get_world_size(self.group)
        self.global_rank_of_self: int = dist.get_rank()
        self.backend: str = str(dist.get_backend(self.group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.stats = CommStats()
        self.trace = Trace()
        self._board = _failure_board(self)
        guard_interpreter_exit()  # the backend's threads may still need the GIL at exit
        self.step: int | None = None
        """The training step, shown in error messages and trace events when set."""
        self._worker = Worker(name)
        self._last_job: Handle | None = None
        weakref.finalize(self, self._worker.shutdown)
        self._owned: dict[Callable[[Communicator], Any], Any] = {}
        self._owned_lock = threading.Lock()
        self.key: str = registry.register(self, self.group.group_name)
        """This communicator's name for ``torch.ops.commfuse.*`` operators, which take plain
        values: ``Communicator.resolve(key)`` returns it (``registry.py``; the same on ranks that
        build the same communicators in the same order)."""

    @staticmethod
    def resolve(key: str) -> Communicator:
        """The live communicator whose ``key`` is ``key``, as an operator finds its own.

        Raises:
            ValueError: no live communicator has that key in this process.

        Example:
            ```python
            assert Communicator.resolve(comm.key) is comm
            ```
        """
        return registry.resolve(key)

    # -- state other layers keep per communicator ---------------------------------------
    def owned(self, kind: Callable[[Communicator], S]) -> S:
        """The one ``kind(self)`` object this communicator owns, made on first use: where a
        higher layer keeps its per-communicator state (the tuner's profile and choices, the
        per-host sub-groups), so it lives and dies with the communicator it serves."""
        with self._owned_lock:
            state = self._owned.get(kind)
            if state is None:
                state = self._owned[kind] = kind(self)
            return cast(S, state)

    # -- the worker thread ----------------------------------------------------------------
    def submit(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Handle:
        """Queue ``fn(*args, **kwargs)`` on this communicator's worker thread behind its earlier
        jobs (see ``worker.py``); ``op`` names it in errors (``all_reduce.ring``). On a worker
        thread already (a job issuing collectives) it runs at once."""
        ctx = OpContext(
            rank=self.rank,
            op=op,
            peer=None,
            nbytes=0,
            step=self.step,
            group=self.name,
            board=self._board,
        )
        handle = Handle(
            self._worker.submit(fn, *args, **kwargs),
            ctx,
            deadline_s=self.config.deadline_s,
            watched=True,
        )
        if not on_worker_thread():
            self._last_job = handle
        return handle

    def drain(self) -> None:
        """Wait for the jobs queued with ``submit`` (re-raising a failure), so a synchronous
        collective issued now runs after them, in the same order on every rank."""
        if on_worker_thread():
            return
        last, self._last_job = self._last_job, None
        if last is not None:
            last.wait()

    # -- bookkeeping ----------------------------------------------------------------------
    def global_rank(self, group_rank: int) -> int:
        """The world rank of ``group_rank`` in this communicator's group."""
        if self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @contextlib.contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        """Label the operations inside with a training step (for errors and traces)."""
        previous, self.step = self.step, step
        try:
            yield
        finally:
            self.step = previous

    def _begin(
        self, kind: str, peer: int | None, nbytes: int
    ) -> tuple[OpContext, TraceEvent | None]:
        ctx = OpContext(
            rank=self.rank,
            op=kind,
            peer=peer,
            nbytes=nbytes,
            step=self.step,
            group=self.name,
            board=self._board,
        )
        event = None
        if self.config.trace:
            event = TraceEvent(
                kind=kind,
                rank=self.global_rank_of_self,
                peer=peer,
                nbytes=nbytes,
                start_us=now_us(),
                step=self.step,
                group=self.name,
            )
            self.trace.events.append(event)
        return ctx, event

    def _handle(self, work: dist.Work | None, ctx: OpContext, event: TraceEvent | None) -> Handle:
        """A point-to-point operation's handle; a large message's waits on a waiting thread
        (``CommConfig.wait_thread_min_bytes``)."""
        least = self.config.wait_thread_min_bytes
        on_thread = least is not None and ctx.nbytes >= least
        return Handle(
            work, ctx, deadline_s=self.config.deadline_s, event=event, on_thread=on_thread
        )

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"{what}={peer} is not a rank of group {self.name!r} (size {self.world_size})"
            )
        if peer == self.rank:
            raise ValueError(
                f"rank {self.rank} cannot {what.split('=')[0]} to/from itself; copy the tensor instead"
            )

    # -- point to point -------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, label: str = "send") -> Handle:
        """Start sending ``tensor`` to group rank ``dst``. ``label`` is the stats/trace kind.

        An empty tensor sends nothing (both ends know its size), so it costs no message.
        """
        self._check_peer(dst, "dst")
        if not tensor.is_contiguous():
            raise ValueError("isend needs a contiguous tensor; call .contiguous() first")
        nbytes = nbytes_of(tensor)
        ctx, event = self._begin(label, dst, nbytes)
        counters = self.stats[label]
        counters.calls += 1
        if nbytes == 0:
            return self._handle(None, ctx, event)
        counters.messages_sent += 1
        counters.bytes_sent += nbytes
        try:
            work = dist.isend(tensor, group=self.group, group_dst=dst, tag=tag)
        except Exception as err:
            raise translate_failure(err, ctx, self.config.deadline_s) from err
        return self._handle(work, ctx, event)

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, label: str = "recv") -> Handle:
        """Start receiving into ``tensor`` from group rank ``src``."""
        self._check_peer(src, "src")
        if not tensor.is_contiguous():
            raise ValueError("irecv needs a contiguous tensor to receive into")
        nbytes = nbytes_of(tensor)
        ctx, event = self._begin(label, src, nbytes)
        counters = self.stats[label]
        counters.calls += 1
        if nbytes == 0:
            return self._handle(None, ctx, event)
        counters.messages_recv += 1
        counters.bytes_recv += nbytes
        try:
            work = dist.irecv(tensor, group=self.group, group_src=src, tag=tag)
        except Exception as err:
            raise translate_failure(err, ctx, self.config.deadline_s) from err
        return self._handle(work, ctx, event)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, label: str = "send") -> None:
        self.isend(tensor, dst, tag=tag, label=label).wait()

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, label: str = "recv") -> None:
        self.irecv(tensor, src, tag=tag, label=label).wait()

    def sendrecv(
        self,
        send: torch.Tensor,
        dst: int,
        recv: torch.Tensor,
        src: int,
        *,
        tag: int = 0,
        label: str = "sendrecv",
    ) -> None:
        """Send to ``dst`` while receiving from ``src`` (both posted before either is waited)."""
        recv_handle = self.irecv(recv, src, tag=tag, label=label)
        send_handle = self.isend(send, dst, tag=tag, label=label)
        send_handle.wait()
        recv_handle.wait()

    # -- native collectives -----------------------------------------------------------------
    def _collective(
        self,
        kind: str,
        payload: torch.Tensor,
        start: Callable[[], dist.Work | None],
        then: Callable[[], None] | None = None,
    ) -> Handle:
        nbytes = nbytes_of(payload)
        ctx, event = self._begin(kind, None, nbytes)
        counters = self.stats[kind]
        counters.calls += 1
        counters.native_bytes += nbytes
        if kind != "barrier":
            counters.handed_bytes += nbytes
        if self.world_size == 1:
            # A world of one: nothing to exchange; the caller's local result is the answer.
            handle = Handle(None, ctx, deadline_s=self.config.deadline_s, event=event, then=then)
            return handle
        try:
            work = start()
        except Exception as err:
            raise translate_failure(err, ctx, self.config.deadline_s) from err
        # gloo's collective works survive a timed-out wait; NCCL's abort the communicator.
        watched = self.backend == "gloo"
        return Handle(
            work, ctx, deadline_s=self.config.deadline_s, event=event, then=then, watched=watched
        )

    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle | None:
        if async_op:
            return handle
        handle.wait()
        return None

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpName = "sum", *, async_op: bool = False
    ) -> Handle | None:
        """In-place all-reduce with the backend's own algorithm (gloo: a ring)."""
        self._validate("all_reduce", tensor)
        red, then = self._reduce_op(op, tensor)
        handle = self._collective(
            "all_reduce",
            tensor,
            lambda: dist.all_reduce(tensor, op=red, group=self.group, async_op=True),
            then,
        )
        return self._finish(handle, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        """In-place broadcast from group rank ``src`` (gloo: a binomial tree)."""
        self._check_root(src, "src")
        self._validate("broadcast", tensor)
        handle = self._collective(
            "broadcast",
            tensor,
            lambda: dist.broadcast(tensor, group=self.group, group_src=src, async_op=True),
        )
        return self._finish(handle, async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOpName = "sum", *, async_op: bool = False
    ) -> Handle | None:
        """Reduce into ``tensor`` on group rank ``dst`` (other ranks' tensors are scratch)."""
        self._check_root(dst, "dst")
        self._validate("reduce", tensor)
        red, then = self._reduce_op(op, tensor, only_on=dst)
        handle = self._collective(
            "reduce",
            tensor,
            lambda: dist.reduce(tensor, group=self.group, group_dst=dst, op=red, async_op=True),
            then,
        )
        return self._finish(handle, async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle | None:
        """``output`` (world_size * input.numel() elements) receives every rank's ``input`` in rank order."""
        self._validate("all_gather", input)
        if output.numel() != input.numel() * self.world_size or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather output must hold world_size x input = {self.world_size} x {input.numel()} {input.dtype} elements, got {output.numel()} {output.dtype}"
            )
        if self.world_size == 1:
            output.view(-1).copy_(input.reshape(-1))
        handle = self._collective(
            "all_gather",
            input,
            lambda: _all_gather_single(output, input, group=self.group, async_op=True),
        )
        return self._finish(handle, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOpName = "sum",
        *,
        async_op: bool = False,
    ) -> Handle | None:
        """``output`` on rank r receives the reduction of block r of every rank's ``input``."""
        self._validate("reduce_scatter", input)
        if input.numel() != output.numel() * self.world_size or output.dtype != input.dtype:
            raise ValueError(
                f"reduce_scatter input must hold world_size x output = {self.world_size} x {output.numel()} {output.dtype} elements, got {input.numel()} {input.dtype}"
            )
        if self.world_size == 1:
            output.view(-1).copy_(input.reshape(-1))
        red, then = self._reduce_op(op, output)
        handle = self._collective(
            "reduce_scatter",
            input,
            lambda: _reduce_scatter_single(output, input, op=red, group=self.group, async_op=True),
            then,
        )
        return self._finish(handle, async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        """Block j of ``input`` goes to rank j; block i of ``output`` comes from rank i (splits along dim 0)."""
        if input_split_sizes is None and input.shape[0] % self.world_size:
            raise ValueError(
                f"all_to_all input dim 0 ({input.shape[0]}) must divide by world size {self.world_size}, or give split sizes"
            )
        if self.world_size == 1:
            output.copy_(input)
        handle = self._collective(
            "all_to_all",
            input,
            lambda: dist.all_to_all_single(
                output,
                input,
                list(output_split_sizes) if output_split_sizes is not None else None,
                list(input_split_sizes) if input_split_sizes is not None else None,
                group=self.group,
                async_op=True,
            ),
        )
        return self._finish(handle, async_op)

    def barrier(self) -> None:
        token = torch.zeros(1, device=self.device)
        self._collective(
            "barrier", token, lambda: dist.all_reduce(token, group=self.group, async_op=True)
        ).wait()

    # -- helpers ------------------------------------------------------------------------------
    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(
                f"{what}={root} is not a rank of group {self.name!r} (size {self.world_size})"
            )

    def _reduce_op(
        self, op: ReduceOpName, tensor: torch.Tensor, only_on: int | None = None
    ) -> tuple[dist.ReduceOp.RedOpType, Callable[[], None] | None]:
        """The backend op, and what to do afterwards (avg = sum, then divide: gloo has no AVG)."""
        if op == "avg":
            if not (tensor.is_floating_point() or tensor.is_complex()):
                raise ValueError(
                    f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide"
                )
            world = self.world_size
            if only_on is not None and only_on != self.rank:
                return dist.ReduceOp.SUM, None

            def divide() -> None:
                tensor.div_(world)

            return dist.ReduceOp.SUM, divide
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}: use one of sum, avg, prod, max, min")
        return _REDUCE_OPS[op], None

    def _validate(self, kind: str, tensor: torch.Tensor) -> None:
        if self.config.validate:
            check_consistent(self, tensor, kind)

    # -- sub-groups -----------------------------------------------------------------------
    def split(self, groups: Sequence[Sequence[int]], *, name: str = "sub") -> Communicator:
        """Partition this group (ranks in this group's numbering); every rank must call it with
        the same ``groups``. Returns the communicator of the part holding this rank."""
        seen = sorted(r for g in groups for r in g)
        if seen != list(range(self.world_size)):
            raise ValueError(
                f"split groups must partition ranks 0..{self.world_size - 1} exactly once, got {list(map(list, groups))}"
            )
        mine: dist.ProcessGroup | None = None
        my_index = next(i for i, members in enumerate(groups) if self.rank in members)
        if self.group is dist.group.WORLD:
            for index, members in enumerate(groups):
                ranks = [self.global_rank(r) for r in members]
                # Every rank creates every group, in the same order: torch names groups by
                # creation order.
                pg = dist.new_group(ranks=ranks)
                if index == my_index:
                    mine = pg
        else:
            # Ranks outside this communicator never call split, so a world-synchronised
            # new_group would wait for them forever: create only our own part, synchronised
            # among its members (torch names it by a hash of its ranks).
            ranks = [self.global_rank(r) for r in groups[my_index]]
            mine = dist.new_group(ranks=ranks, use_local_synchronization=True)
        assert mine is not None
        return Communicator(mine, config=self.config, name=f"{name}{my_index}")

    def split_by_host(self, ranks_per_host: int) -> tuple[Communicator, Communicator]:
        """(ranks of my host, ranks with my local rank on every host): the two levels of a
        hierarchical algorithm. Ranks are host-major, as the launcher places them."""
        if ranks_per_host < 1 or self.world_size % ranks_per_host:
            raise ValueError(
                f"ranks_per_host={ranks_per_host} must divide the group size {self.world_size}"
            )
        num_hosts = self.world_size // ranks_per_host
        intra = self.split(
            [list(range(h * ranks_per_host, (h + 1) * ranks_per_host)) for h in range(num_hosts)],
            name="host",
        )
        inter = self.split(
            [list(range(lr, self.world_size, ranks_per_host)) for lr in range(ranks_per_host)],
            name="cross",
        )
        return intra, inter


#: dtype codes for the consistency check (any stable numbering works; both sides use this one).
_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        [
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.complex128,
        ]
    )
}
_META_DIMS = 6


def check_consistent(comm: Communicator, tensor: torch.Tensor, kind: str) -> None:
    """Raise InconsistentInputError if ranks pass tensors of different dtype or shape.

    Gathers (dtype, ndim, shape...) from every rank with the native all-gather, after the
    communicator's queued jobs; the message lists what each disagreeing rank passed. Costs one
    small collective.
    """
    meta = torch.full((2 + _META_DIMS,), -1, dtype=torch.int64, device=comm.device)
    meta[0] = _DTYPE_CODES.get(tensor.dtype, 99)
    meta[1] = tensor.dim()
    for i, size in enumerate(tensor.shape[:_META_DIMS]):
        meta[2 + i] = size
    if comm.world_size == 1:
        return
    # A collective of its own: after the jobs already queued, as on every rank (issued beside
    # them, it could overtake one on one rank and not on another).
    comm.drain()
    everyone = torch.empty(comm.world_size * meta.numel(), dtype=torch.int64, device=comm.device)
    ctx = OpContext(
        rank=comm.rank,
        op=f"{kind} (input check)",
        peer=None,
        nbytes=0,
        step=comm.step,
        group=comm.name,
    )
    try:
        work = _all_gather_single(everyone, meta, group=comm.group, async_op=True)
        assert work is not None
        Handle(work, ctx, deadline_s=comm.config.deadline_s).wait()
    except Exception as err:
        raise translate_failure(err, ctx, comm.config.deadline_s) from err
    rows = everyone.view(comm.world_size, -1)
    if bool((rows == rows[0]).all()):
        return
    inverse = {code: dtype for dtype, code in _DTYPE_CODES.items()}
    described = []
    for rank, row in enumerate(rows.tolist()):
        dims = [d for d in row[2 : 2 + row[1]]]
        described.append(f"rank {rank}: {inverse.get(row[0], 'other')} {tuple(dims)}")
    raise InconsistentInputError(
        f"{kind}: ranks passed different tensors ({'; '.join(described)}); every rank must pass the same shape and dtype"
    )

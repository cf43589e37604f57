"""The front door: ``all_reduce(comm, tensor, op, algo=...)`` and friends.

Every call goes through one path (``_call``), in five steps:

1. **validate**: dtype, contiguity, shapes, root, reduction op and the algorithm name, each a
   ValueError that names the argument (never a hang on bad input); with
   ``CommConfig.validate`` also that every rank passes the same shape and dtype;
2. **fast paths**: a world of one or an empty tensor needs no communication;
3. **pick**: ``algo="auto"`` asks the tuner for the algorithm and its options (the same on every
   rank; during a timed trial at first use, ``trial.py``, the candidate whose turn it is, and
   the call is timed), any registered name or alias forces one;
4. **count**: commfuse's own algorithms count the caller's buffer as handed to a collective
   (``OpCounters.handed_bytes``; gloo's count it where they run);
5. **run**: synchronously, or with ``async_op=True`` on the communicator's worker thread,
   returning a ``Handle`` whose ``wait()`` has the communicator's deadline.

The six functions differ only in what they validate, which buffer sizes the choice and what the
algorithm is called with. Out-of-place forms write into ``out`` and leave the input untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse.collectives.reduce_ops import check_op, finish_
from commfuse.collectives.registry import AlgorithmFn, Collective, algorithms_for, label, resolve
from commfuse.collectives.trial import next_call as trial_call
from commfuse.collectives.tuner import choose, choose_options
from commfuse.comm import Communicator, Handle, ReduceOpName, check_consistent, nbytes_of
from commfuse.comm.clock import now

_SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
)

#: Runs the picked algorithm ``fn`` (registered as ``name``) with its options.
_Body = Callable[[str, AlgorithmFn, dict[str, Any]], None]


def _call(
    comm: Communicator,
    collective: Collective,
    body: _Body,
    tensor: torch.Tensor,
    *,
    algo: str,
    async_op: bool,
    opts: dict[str, Any],
    sized: torch.Tensor | None = None,
    empty: bool | None = None,
    local: Callable[[], object] | None = None,
    same_on_every_rank: bool = True,
) -> Handle | None:
    """Steps 1 (the shared part) to 5 of the module docstring, for arguments the caller has
    validated. ``tensor`` is this rank's buffer: counted as handed, checked against the other
    ranks' (unless ``same_on_every_rank`` is false) and, unless ``sized`` is given, what the
    tuner sizes the message by. ``empty`` (default: ``tensor`` has no element) or a world of
    one needs no communication; ``local`` then gives the result."""
    table = algorithms_for(collective)
    if algo != "auto" and resolve(collective, algo) not in table:
        raise ValueError(
            f"unknown {collective} algorithm {algo!r}: use auto or one of {', '.join(sorted(table))}"
        )
    if same_on_every_rank and comm.config.validate:
        check_consistent(comm, tensor, collective)
    if comm.world_size == 1 or (tensor.numel() == 0 if empty is None else empty):
        if local is not None:
            local()
        return Handle.completed(op=collective) if async_op else None
    nbytes = nbytes_of(tensor if sized is None else sized)
    trial = trial_call(comm, collective, nbytes, tensor) if algo == "auto" else None
    if trial is None:
        name, opts = _pick(comm, collective, algo, nbytes, opts)
        record = None
    else:
        name, record = trial
        opts = {**choose_options(comm, collective, name, nbytes), **opts}
    if name != "native":
        comm.stats[label(collective, name)].handed_bytes += nbytes_of(tensor)
    fn = table[name]

    def run() -> None:
        if record is None:
            body(name, fn, opts)
            return
        start = now(tensor.device)
        body(name, fn, opts)
        record(now(tensor.device) - start)

    if async_op:
        return comm.submit(f"{collective}.{name}", run)
    comm.drain()
    run()
    return None


def _pick(
    comm: Communicator, collective: Collective, algo: str, nbytes: int, opts: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The algorithm to run and its options. ``auto`` asks the tuner for both (for pipelines,
    the modelled best block size); options the caller gave explicitly win."""
    if algo == "auto":
        name = choose(comm, collective, nbytes)
        return name, {**choose_options(comm, collective, name, nbytes), **opts}
    return resolve(collective, algo), opts


def all_reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    op: ReduceOpName = "sum",
    *,
    algo: str = "auto",
    out: torch.Tensor | None = None,
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Reduce ``tensor`` over all ranks; the result lands in ``tensor`` (or ``out``). The
    arguments every collective takes, its result and its errors: ``commfuse.collectives``.

    Args:
        tensor: this rank's contribution.
        op: the reduction.
        out: where the result goes instead of ``tensor`` (same shape and dtype); ``tensor`` is
            then left untouched.

    Returns:
        A ``Handle`` with ``async_op``, else None (see ``commfuse.collectives``).

    Raises:
        ValueError: an ``out`` of another shape or dtype, besides the common errors.

    Example:
        ```python
        all_reduce(comm, grad, "avg", algo="ring")
        ```
    """
    _check_tensor(tensor, "all_reduce tensor")
    check_op(op, tensor.dtype)
    if out is not None:
        if out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(
                f"all_reduce out must match the input: {tuple(tensor.shape)} {tensor.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        _check_tensor(out, "all_reduce out")
        out.copy_(tensor)
    target = tensor if out is None else out

    def body(name: str, fn: AlgorithmFn, options: dict[str, Any]) -> None:
        fn(comm, target.view(-1), op, **options)
        if name != "native":
            finish_(target, op, comm.world_size)

    return _call(comm, "all_reduce", body, target, algo=algo, async_op=async_op, opts=opts)


def broadcast(
    comm: Communicator,
    tensor: torch.Tensor,
    root: int = 0,
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Copy root's ``tensor`` into every rank's ``tensor``.

    Args:
        tensor: root's data to send; on the other ranks, the buffer that receives it (the same
            shape and dtype everywhere).
        root: the sending rank.

    Returns:
        A ``Handle`` with ``async_op``, else None (see ``commfuse.collectives``).

    Raises:
        ValueError: a root outside the group, besides the common errors.

    Example:
        ```python
        broadcast(comm, params, root=0, algo="pipeline")  # linear pipeline: time independent of P
        ```
    """
    _check_tensor(tensor, "broadcast tensor")
    _check_root(comm, root)

    def body(name: str, fn: AlgorithmFn, options: dict[str, Any]) -> None:
        fn(comm, tensor.view(-1), root, **options)

    return _call(comm, "broadcast", body, tensor, algo=algo, async_op=async_op, opts=opts)


def _check_root(comm: Communicator, root: int) -> None:
    """The root of ``broadcast`` and ``reduce`` must be a rank of ``comm``."""
    if not 0 <= root < comm.world_size:
        raise ValueError(
            f"root={root} is not a rank of group {comm.name!r} (size {comm.world_size})"
        )


def reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    root: int = 0,
    op: ReduceOpName = "sum",
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Reduce every rank's ``tensor`` into root's; the others are left unchanged.

    Args:
        tensor: this rank's contribution; on root, also where the result lands.
        root: the rank that receives the result.
        op: the reduction.

    Returns:
        A ``Handle`` with ``async_op``, else None (see ``commfuse.collectives``).

    Raises:
        ValueError: a root outside the group, or an op this dtype cannot reduce with, besides
            the common errors.

    Example:
        ```python
        reduce(comm, loss_sum, root=0, op="sum", algo="tree")
        ```
    """
    _check_tensor(tensor, "reduce tensor")
    check_op(op, tensor.dtype)
    _check_root(comm, root)

    def body(name: str, fn: AlgorithmFn, options: dict[str, Any]) -> None:
        fn(comm, tensor.view(-1), root, op, **options)
        if name != "native" and comm.rank == root:
            finish_(tensor, op, comm.world_size)

    return _call(comm, "reduce", body, tensor, algo=algo, async_op=async_op, opts=opts)


def all_gather(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """``out`` receives every rank's ``inp`` in rank order.

    Args:
        out: ``world_size`` times ``inp``'s elements, of ``inp``'s dtype.
        inp: this rank's block.

    Returns:
        A ``Handle`` with ``async_op``, else None (see ``commfuse.collectives``).

    Raises:
        ValueError: an ``out`` that is not ``world_size`` blocks of ``inp``'s size and dtype,
            besides the common errors.

    Example:
        ```python
        gathered = shard.new_empty(comm.world_size * shard.numel())  # on the shard's device
        all_gather(comm, gathered, shard, algo="ring")
        ```
    """
    _check_tensor(inp, "all_gather input")
    _check_tensor(out, "all_gather output")
    _check_world_multiple("all_gather output", out, "input", inp, comm.world_size)

    def body(name: str, fn: AlgorithmFn, options: dict[str, Any]) -> None:
        fn(comm, out.view(-1), inp.view(-1), **options)

    return _call(
        comm,
        "all_gather",
        body,
        inp,
        algo=algo,
        async_op=async_op,
        opts=opts,
        sized=out,
        local=lambda: out.view(-1).copy_(inp.view(-1)),
    )


def reduce_scatter(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    op: ReduceOpName = "sum",
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """``out`` on rank r receives the reduction of block r of every rank's ``inp``.

    Args:
        out: receives the reduction of block ``comm.rank`` of every rank's ``inp``.
        inp: ``world_size`` blocks of ``out``'s size and dtype, block r for rank r.
        op: the reduction.

    Returns:
        A ``Handle`` with ``async_op``, else None (see ``commfuse.collectives``).

    Raises:
        ValueError: an ``inp`` that is not ``world_size`` blocks of ``out``, besides the common
            errors.

    Example:
        ```python
        shard = grads.new_empty(grads.numel() // comm.world_size)  # on the gradient's device
        reduce_scatter(comm, shard, grads, "avg", algo="halving")  # Rabenseifner's first half
        ```
    """
    _check_tensor(inp, "reduce_scatter input")
    _check_tensor(out, "reduce_scatter output")
    check_op(op, inp.dtype)
    _check_world_multiple("reduce_scatter input", inp, "output", out, comm.world_size)

    def body(name: str, fn: AlgorithmFn, options: dict[str, Any]) -> None:
        fn(comm, out.view(-1), inp.view(-1), op, **options)
        if name != "native":
            finish_(out, op, comm.world_size)

    return _call(
        comm,
        "reduce_scatter",
        body,
        inp,
        algo=algo,
        async_op=async_op,
        opts=opts,
        empty=out.numel() == 0,
        local=lambda: out.view(-1).copy_(inp.view(-1)),
    )


def all_to_all(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int] | None = None,
    in_splits: Sequence[int] | None = None,
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Block j of ``inp`` goes to rank j; block i of ``out`` comes from rank i. Splits count rows
    of dim 0 (equal blocks when omitted); ranks may pass different splits, so with explicit
    ones ``algo="auto"`` runs the backend's own exchange (per-rank sizes could make per-rank
    tuner choices differ, and deadlock).

    Args:
        out: receives block i from rank i (rows of dim 0, ``out_splits`` of them).
        inp: block j goes to rank j (rows of dim 0, ``in_splits`` of them); every dim but the
            first matches ``out``'s.
        out_splits: rows received from each rank; None: equal blocks.
        in_splits: rows sent to each rank; None: equal blocks.

    Returns:
        A ``Handle`` with ``async_op``, else None (see ``commfuse.collectives``).

    Raises:
        ValueError: rows that differ between ``inp`` and ``out``, splits that do not sum to
            dim 0, or a dim 0 that does not divide by the world size without them, besides the
            common errors.

    Example:
        ```python
        received = torch.empty_like(tokens)
        all_to_all(comm, received, tokens, algo="pairwise")
        ```
    """
    _check_tensor(inp, "all_to_all input")
    _check_tensor(out, "all_to_all output")
    world = comm.world_size
    explicit_splits = in_splits is not None or out_splits is not None
    rows_in, rows_out = (
        (inp.shape[0] if inp.dim() else inp.numel()),
        (out.shape[0] if out.dim() else out.numel()),
    )
    # Elements per row from the shape, not from a row: a rank may send or receive no rows.
    row = math.prod(inp.shape[1:]) if inp.dim() else 1
    if (math.prod(out.shape[1:]) if out.dim() else 1) != row:
        raise ValueError(
            f"all_to_all rows differ: input {tuple(inp.shape)} vs output {tuple(out.shape)} "
            "(every dim but the first must match)"
        )
    if in_splits is None:
        if rows_in % world:
            raise ValueError(
                f"all_to_all input dim 0 ({rows_in}) must divide by world size {world}, or give in_splits"
            )
        in_splits = [rows_in // world] * world
    if out_splits is None:
        if rows_out % world:
            raise ValueError(
                f"all_to_all output dim 0 ({rows_out}) must divide by world size {world}, or give out_splits"
            )
        out_splits = [rows_out // world] * world
    if (
        len(in_splits) != world
        or len(out_splits) != world
        or sum(in_splits) != rows_in
        or sum(out_splits) != rows_out
    ):
        raise ValueError(
            f"all_to_all splits must have {world} entries summing to dim 0 of input ({rows_in}) and output ({rows_out})"
        )
    if algo == "auto" and explicit_splits:
        algo = "native"
    rows_to, rows_from = list(in_splits), list(out_splits)

    def body(name: str, fn: AlgorithmFn, options: dict[str, Any]) -> None:
        if name == "native":  # gloo's exchange takes the shaped tensors and row splits
            fn(comm, out, inp, rows_from, rows_to, **options)
        else:
            elems_from, elems_to = [s * row for s in rows_from], [s * row for s in rows_to]
            fn(comm, out.view(-1), inp.view(-1), elems_from, elems_to, **options)

    return _call(
        comm,
        "all_to_all",
        body,
        inp,
        algo=algo,
        async_op=async_op,
        opts=opts,
        empty=False,  # a world of one is the only fast path: ranks may send nothing
        local=lambda: out.copy_(inp),
        same_on_every_rank=False,  # ranks may send different amounts
    )


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"{what} has dtype {tensor.dtype}; supported: {', '.join(str(d).removeprefix('torch.') for d in _SUPPORTED_DTYPES)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")


def _check_world_multiple(
    whole_name: str, whole: torch.Tensor, part_name: str, part: torch.Tensor, world: int
) -> None:
    """The buffer that holds every rank's block must be world_size blocks of the same dtype."""
    if whole.numel() != part.numel() * world or whole.dtype != part.dtype:
        raise ValueError(
            f"{whole_name} must hold world_size x {part_name} = {world} x {part.numel()} "
            f"{part.dtype} elements, got {whole.numel()} {whole.dtype}"
        )

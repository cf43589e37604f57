"""The front door: ``all_reduce(comm, tensor, op, algo=...)`` and friends.

Each call validates its arguments (a clear ValueError, never a hang on bad input), flattens the
tensor, takes the fast paths (world of one, empty tensor), picks the algorithm (``algo="auto"``
asks the tuner; any registered name forces one), and runs it synchronously or, with
``async_op=True``, on the communicator's worker thread, returning a handle with ``wait()``.
Out-of-place forms write into ``out`` and leave the input untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from commfuse.collectives.executor import CollectiveHandle, CompletedHandle, drain, submit
from commfuse.collectives.reduce_ops import check_op, finish_
from commfuse.collectives.registry import algorithms_for, label, resolve
from commfuse.comm import Communicator, check_consistent

Handle = CollectiveHandle | CompletedHandle
SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
)


def _pick(
    comm: Communicator, collective: str, algo: str, nbytes: int, opts: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The algorithm to run and its options. ``auto`` asks the tuner for both (for pipelines,
    the modelled best block size); options the caller gave explicitly win."""
    table = algorithms_for(collective)
    if algo == "auto":
        from commfuse.collectives.tuner import choose, choose_options

        name = choose(comm, collective, nbytes)
        return name, {**choose_options(comm, collective, name, nbytes), **opts}
    name = resolve(collective, algo)
    if name not in table:
        raise ValueError(
            f"unknown {collective} algorithm {algo!r}: use auto or one of {', '.join(sorted(table))}"
        )
    return name, opts


def _count_handed(comm: Communicator, collective: str, name: str, tensor: torch.Tensor) -> None:
    """Count the caller's buffer as handed to a collective (``OpCounters.handed_bytes``) once:
    gloo's own collectives count it where they run, commfuse's algorithms here, under the kind
    that holds their point-to-point traffic."""
    if name != "native":
        comm.stats[label(collective, name)].handed_bytes += tensor.numel() * tensor.element_size()


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{what} has dtype {tensor.dtype}; supported: {', '.join(str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")


def _run(
    comm: Communicator, description: str, async_op: bool, fn: Any, *args: Any, **kwargs: Any
) -> Handle | None:
    if async_op:
        return submit(comm, description, fn, *args, **kwargs)
    drain(comm)
    fn(*args, **kwargs)
    return None


def all_reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    algo: str = "auto",
    out: torch.Tensor | None = None,
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Reduce ``tensor`` over all ranks; the result lands in ``tensor`` (or ``out``)."""
    _check_tensor(tensor, "all_reduce tensor")
    check_op(op, tensor.dtype)
    if comm.config.validate:
        check_consistent(comm, tensor, "all_reduce")
    target = tensor
    if out is not None:
        if out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(
                f"all_reduce out must match the input: {tuple(tensor.shape)} {tensor.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        _check_tensor(out, "all_reduce out")
        out.copy_(tensor)
        target = out
    if comm.world_size == 1 or target.numel() == 0:
        return CompletedHandle() if async_op else None
    name, opts = _pick(comm, "all_reduce", algo, target.numel() * target.element_size(), opts)
    _count_handed(comm, "all_reduce", name, target)
    fn = algorithms_for("all_reduce")[name]

    def body() -> None:
        fn(comm, target.view(-1), op, **opts)
        if name != "native":
            finish_(target, op, comm.world_size)

    return _run(comm, f"all_reduce.{name}", async_op, body)


def broadcast(
    comm: Communicator,
    tensor: torch.Tensor,
    root: int = 0,
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Copy root's ``tensor`` into every rank's ``tensor``."""
    _check_tensor(tensor, "broadcast tensor")
    _check_root(comm, root)
    if comm.config.validate:
        check_consistent(comm, tensor, "broadcast")
    if comm.world_size == 1 or tensor.numel() == 0:
        return CompletedHandle() if async_op else None
    name, opts = _pick(comm, "broadcast", algo, tensor.numel() * tensor.element_size(), opts)
    _count_handed(comm, "broadcast", name, tensor)
    return _run(
        comm,
        f"broadcast.{name}",
        async_op,
        algorithms_for("broadcast")[name],
        comm,
        tensor.view(-1),
        root,
        **opts,
    )


def reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    root: int = 0,
    op: str = "sum",
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """Reduce every rank's ``tensor`` into root's; the others are left unchanged."""
    _check_tensor(tensor, "reduce tensor")
    check_op(op, tensor.dtype)
    _check_root(comm, root)
    if comm.config.validate:
        check_consistent(comm, tensor, "reduce")
    if comm.world_size == 1 or tensor.numel() == 0:
        return CompletedHandle() if async_op else None
    name, opts = _pick(comm, "reduce", algo, tensor.numel() * tensor.element_size(), opts)
    _count_handed(comm, "reduce", name, tensor)
    fn = algorithms_for("reduce")[name]

    def body() -> None:
        fn(comm, tensor.view(-1), root, op, **opts)
        if name != "native" and comm.rank == root:
            finish_(tensor, op, comm.world_size)

    return _run(comm, f"reduce.{name}", async_op, body)


def all_gather(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """``out`` (world_size x inp.numel() elements) receives every rank's ``inp`` in rank order."""
    _check_tensor(inp, "all_gather input")
    _check_tensor(out, "all_gather output")
    _check_world_multiple("all_gather output", out, "input", inp, comm.world_size)
    if comm.config.validate:
        check_consistent(comm, inp, "all_gather")
    if comm.world_size == 1 or inp.numel() == 0:
        out.view(-1).copy_(inp.view(-1))
        return CompletedHandle() if async_op else None
    name, opts = _pick(comm, "all_gather", algo, out.numel() * out.element_size(), opts)
    _count_handed(comm, "all_gather", name, inp)
    return _run(
        comm,
        f"all_gather.{name}",
        async_op,
        algorithms_for("all_gather")[name],
        comm,
        out.view(-1),
        inp.view(-1),
        **opts,
    )


def reduce_scatter(
    comm: Communicator,
    out: torch.Tensor,
    inp: torch.Tensor,
    op: str = "sum",
    *,
    algo: str = "auto",
    async_op: bool = False,
    **opts: Any,
) -> Handle | None:
    """``out`` on rank r receives the reduction of block r of every rank's ``inp``."""
    _check_tensor(inp, "reduce_scatter input")
    _check_tensor(out, "reduce_scatter output")
    check_op(op, inp.dtype)
    _check_world_multiple("reduce_scatter input", inp, "output", out, comm.world_size)
    if comm.config.validate:
        check_consistent(comm, inp, "reduce_scatter")
    if comm.world_size == 1 or out.numel() == 0:
        out.view(-1).copy_(inp.view(-1))
        return CompletedHandle() if async_op else None
    name, opts = _pick(comm, "reduce_scatter", algo, inp.numel() * inp.element_size(), opts)
    _count_handed(comm, "reduce_scatter", name, inp)
    fn = algorithms_for("reduce_scatter")[name]

    def body() -> None:
        fn(comm, out.view(-1), inp.view(-1), op, **opts)
        if name != "native":
            finish_(out, op, comm.world_size)

    return _run(comm, f"reduce_scatter.{name}", async_op, body)


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
    of dim 0 (equal blocks when omitted)."""
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
    if world == 1:
        out.copy_(inp)
        return CompletedHandle() if async_op else None
    if algo == "auto" and explicit_splits:
        # Uneven splits give each rank a different size, so per-rank tuner choices could
        # differ (and deadlock); the backend's own exchange is the one choice all ranks share.
        algo = "native"
    name, opts = _pick(comm, "all_to_all", algo, inp.numel() * inp.element_size(), opts)
    _count_handed(comm, "all_to_all", name, inp)
    fn = algorithms_for("all_to_all")[name]
    if name == "native":
        return _run(
            comm,
            "all_to_all.native",
            async_op,
            fn,
            comm,
            out,
            inp,
            list(out_splits),
            list(in_splits),
            **opts,
        )
    elems_out = [s * row for s in out_splits]
    elems_in = [s * row for s in in_splits]
    return _run(
        comm,
        f"all_to_all.{name}",
        async_op,
        fn,
        comm,
        out.view(-1),
        inp.view(-1),
        elems_out,
        elems_in,
        **opts,
    )


def _check_world_multiple(
    whole_name: str, whole: torch.Tensor, part_name: str, part: torch.Tensor, world: int
) -> None:
    """The buffer that holds every rank's block must be world_size blocks of the same dtype."""
    if whole.numel() != part.numel() * world or whole.dtype != part.dtype:
        raise ValueError(
            f"{whole_name} must hold world_size x {part_name} = {world} x {part.numel()} "
            f"{part.dtype} elements, got {whole.numel()} {whole.dtype}"
        )


def _check_root(comm: Communicator, root: int) -> None:
    if not 0 <= root < comm.world_size:
        raise ValueError(
            f"root={root} is not a rank of group {comm.name!r} (size {comm.world_size})"
        )

"""One gossip round on the wire: the flat model, the check that ranks hold one model, the mix.

Every round posts all of a rank's receives, then all of its sends, and only then waits on any
of them (``Communicator.irecv``/``isend``, each wait bounded by the communicator's deadline).
No rank blocks before its own sends are posted, so no cycle of waits can form whatever the
graph (a blocking exchange would need an order such as "the lower rank sends first"); gloo
has no stable ``batch_isend_irecv``, so none is used. Between two ranks there is at most one
message each way per round, and gloo delivers a pair's messages in the order they were
posted, so rounds cannot mix. Each message counts under the caller's label in
``comm.stats``: bytes per rank per round are exactly (numel x element size) per peer sent to.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from commfuse.comm import Communicator, Handle, InconsistentInputError, wait_all
from commfuse.decentral.topology import Edges

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class FlatParams:
    """A list of parameters seen as one flat vector (one message per peer per round).

    Raises:
        ValueError: no parameters, a parameter that is not floating-point, or parameters of
            different dtypes or devices.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("gossip needs at least one parameter")
        first = self.params[0]
        for p in self.params:
            if p.dtype not in _DTYPES:
                raise ValueError(f"gossip averages floating-point parameters, got {p.dtype}")
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    "gossip needs every parameter in one dtype on one device, got "
                    f"{first.dtype} on {first.device} and {p.dtype} on {p.device}"
                )
        self.dtype, self.device = first.dtype, first.device
        self.numel = sum(p.numel() for p in self.params)

    def gather(self) -> torch.Tensor:
        """A fresh flat copy of the parameters, on their device."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def scatter(self, flat: torch.Tensor) -> None:
        """Write ``flat`` back into the parameters."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def describe(self) -> str:
        return f"{len(self.params)} tensors, {self.numel} {self.dtype} elements"


def check_same_model(comm: Communicator, flat: FlatParams, what: str) -> None:
    """Raise ``InconsistentInputError`` unless every rank holds parameters of the same shapes
    and dtype (one small all-gather; nothing on one rank).

    Raises:
        InconsistentInputError: the ranks' parameters differ; the message lists each rank's.
    """
    if comm.world_size == 1:
        return
    shapes = tuple(tuple(p.shape) for p in flat.params)
    # hash() of a tuple of ints is the same in every process (only str hashing is salted).
    signature = [len(flat.params), flat.numel, _DTYPES.index(flat.dtype), hash(shapes) >> 2]
    mine = torch.tensor(signature, dtype=torch.int64, device=comm.device)
    everyone = torch.empty(comm.world_size * mine.numel(), dtype=torch.int64, device=comm.device)
    comm.all_gather(everyone, mine)
    rows = everyone.view(comm.world_size, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    described = "; ".join(
        f"rank {r}: {row[0]} tensors, {row[1]} {_DTYPES[row[2]]} elements"
        + ("" if row[3] == rows[0][3] else " (other shapes)")
        for r, row in enumerate(rows)
    )
    raise InconsistentInputError(
        f"{what}: ranks hold different parameters ({described}); every rank must gossip the "
        "same model"
    )


def swap(
    comm: Communicator, mine: torch.Tensor, edges: Edges, *, label: str
) -> list[tuple[torch.Tensor, float]]:
    """Send ``mine`` to every peer in ``edges.send``; return each message received from
    ``edges.recv`` with its weight W[i, j]. Every buffer is made on ``mine``'s device."""
    handles: list[Handle] = []
    received: list[tuple[torch.Tensor, float]] = []
    for src, weight in edges.recv:
        buf = torch.empty_like(mine)
        handles.append(comm.irecv(buf, src, label=label))
        received.append((buf, weight))
    for dst, _ in edges.send:
        handles.append(comm.isend(mine, dst, label=label))
    wait_all(handles)
    return received


def exchange(comm: Communicator, mine: torch.Tensor, edges: Edges, *, label: str) -> torch.Tensor:
    """One round for this rank: W[i, i] x_i + sum_j W[i, j] x_j over the peers it hears from
    (``swap``)."""
    received = swap(comm, mine, edges, label=label)
    out = mine * edges.keep
    for buf, weight in received:
        out.add_(buf, alpha=weight)
    return out

"""Gossip topologies as data: for round t, every rank's peers and weights, and the matrix W(t).

A round of gossip replaces every rank's vector x_i by sum_j W(t)[i, j] x_j. Column i of W(t)
is what rank i gives away: W(t)[j, i] to each peer j, W(t)[i, i] kept. A topology states its
columns (``column(t, i)``); the peers of a rank (``edges``) and the dense matrix
(``matrix``) are read from them, so the runtime and the tests use one definition.

* ``Ring`` and ``Torus``: fixed undirected graphs, Metropolis-Hastings weights
  W[i, j] = 1 / (1 + max(deg i, deg j)) (Xiao and Boyd, "Fast linear iterations for
  distributed averaging", 2004), which on these regular graphs is 1 / (deg + 1): the ring of
  D-PSGD (Lian et al., NeurIPS 2017) averages each rank with its two neighbours, 1/3 each.
* ``ShiftOne``: Bagua's time-varying perfect matching (Gan et al., VLDB 2022): rank i of the
  lower half pairs with ``n/2 + (t + i) mod n/2``, and each pair averages, 1/2 each. Bagua
  refuses an odd world; here an odd world runs the formula on n + 1 ranks and the rank paired
  with the missing one sits the round out (W[i, i] = 1).
* ``Exponential``: SGP's one-peer directed exponential graph (Assran et al., ICML 2019): round
  t uses offset s = SGP's phone book [1, -1, 2, -2, 4, -4, ...] (mod n, repeats dropped, up to
  2^floor(log2(n - 1))) at t mod its length; rank i keeps 1/2 and pushes 1/2 to i + s.
* ``Explicit``: any sequence of matrices, W(t) = matrices[t mod len].

Undirected topologies give symmetric, doubly stochastic W(t) (D-PSGD needs that); a directed
one gives a column-stochastic W(t), which PushSum needs and which keeps sum_i x_i.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from fractions import Fraction
from typing import ClassVar

import torch

#: How far from 1 a column (or row) of an ``Explicit`` matrix may sum.
STOCHASTIC_ATOL = 1e-12


@dataclasses.dataclass(frozen=True)
class Edges:
    """One rank's share of a round: what it keeps, whom it sends to, whom it hears from."""

    keep: float
    """W(t)[i, i]: the weight of the rank's own vector."""
    send: tuple[tuple[int, float], ...]
    """(peer j, W(t)[j, i]) for every other rank that receives this rank's vector, by rank."""
    recv: tuple[tuple[int, float], ...]
    """(peer j, W(t)[i, j]) for every other rank whose vector this rank receives, by rank."""


class Topology(abc.ABC):
    """A gossip graph over ``world_size`` ranks, possibly changing every round (module
    docstring). Subclasses give ``column`` and ``period``; the rest is read from them."""

    #: The name on the command line (``gossip:topology=ring``).
    name: ClassVar[str]
    #: True: W(t) is only column-stochastic (PushSum); False: symmetric, doubly stochastic.
    directed: bool = False
    #: Whether every W(t) is doubly stochastic (rows sum to 1 too): gossip averaging keeps the
    #: average on it. True for every undirected topology and for SGP's exponential graph.
    doubly_stochastic: bool = True

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"a topology needs world_size >= 1, got {world_size}")
        self.world_size = world_size

    @property
    @abc.abstractmethod
    def period(self) -> int:
        """Rounds after which W(t) repeats: W(t + period) = W(t)."""

    @abc.abstractmethod
    def column(self, t: int, rank: int) -> dict[int, float]:
        """Column ``rank`` of W(t): each receiving rank (``rank`` itself included) and its
        weight; the weights sum to 1."""

    def edges(self, t: int, rank: int) -> Edges:
        """``rank``'s peers and weights in round ``t`` (read from the columns, cached)."""
        return self._edges(t % self.period, rank)

    @functools.lru_cache(maxsize=4096)  # noqa: B019  # a topology lives as long as its run
    def _edges(self, t: int, rank: int) -> Edges:
        mine = self.column(t, rank)
        send = tuple(sorted((j, w) for j, w in mine.items() if j != rank and w != 0.0))
        recv = []
        for j in range(self.world_size):
            if j != rank:
                w = self.column(t, j).get(rank, 0.0)
                if w != 0.0:
                    recv.append((j, w))
        return Edges(keep=mine.get(rank, 0.0), send=send, recv=tuple(recv))

    def matrix(self, t: int) -> torch.Tensor:
        """W(t) as a dense fp64 ``world_size x world_size`` tensor (for tests and analysis)."""
        n = self.world_size
        # An analysis object, not a buffer of the exchange: it lives on the CPU by choice.
        out = torch.zeros(n, n, dtype=torch.float64, device="cpu")
        for i in range(n):
            for j, w in self.column(t, i).items():
                out[j, i] = w
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.world_size})"


class _Undirected(Topology):
    """An undirected graph with Metropolis-Hastings weights; subclasses give ``neighbours``."""

    @abc.abstractmethod
    def neighbours(self, t: int, rank: int) -> set[int]:
        """The other ranks ``rank`` averages with in round ``t`` (a symmetric relation)."""

    def column(self, t: int, rank: int) -> dict[int, float]:
        mine = self.neighbours(t, rank)
        # Exact fractions, so a regular graph keeps exactly 1 / (deg + 1), as it gives away.
        given = {j: Fraction(1, 1 + max(len(mine), len(self.neighbours(t, j)))) for j in mine}
        out = {j: float(given[j]) for j in sorted(given)}
        out[rank] = float(1 - sum(given.values(), Fraction(0)))
        return out


class Ring(_Undirected):
    """Each rank averages with its two neighbours on a ring (D-PSGD: 1/3 each; on 2 ranks the
    two neighbours are one, 1/2 each)."""

    name = "ring"

    @property
    def period(self) -> int:
        return 1

    def neighbours(self, t: int, rank: int) -> set[int]:
        n = self.world_size
        return {(rank - 1) % n, (rank + 1) % n} - {rank}


class Torus(_Undirected):
    """A ``rows x cols`` grid wrapped at its edges; each rank averages with up to four
    neighbours (1/5 each on a torus of at least 3 x 3).

    Args:
        world_size: the number of ranks.
        rows: the grid's rows (a divisor of ``world_size``); None: the largest divisor at most
            sqrt(world_size), so a prime world size is a ring.

    Raises:
        ValueError: ``rows`` does not divide ``world_size``.
    """

    name = "torus"

    def __init__(self, world_size: int, rows: int | None = None) -> None:
        super().__init__(world_size)
        if rows is None:
            rows = max(d for d in range(1, int(world_size**0.5) + 1) if world_size % d == 0)
        if rows < 1 or world_size % rows:
            raise ValueError(f"a torus of {world_size} ranks needs rows dividing it, got {rows}")
        self.rows, self.cols = rows, world_size // rows

    @property
    def period(self) -> int:
        return 1

    def neighbours(self, t: int, rank: int) -> set[int]:
        r, c = divmod(rank, self.cols)
        found = {((r + d) % self.rows) * self.cols + c for d in (-1, 1)}
        found |= {r * self.cols + (c + d) % self.cols for d in (-1, 1)}
        return found - {rank}

    def __repr__(self) -> str:
        return f"Torus({self.world_size}, rows={self.rows})"


def bagua_shift_one_peer(rank: int, world_size: int, t: int) -> int:
    """Bagua's ``shift_one`` peer of ``rank`` in communication round ``t`` (an even world)."""
    half = world_size // 2
    if rank < half:
        return (t + rank) % ((world_size + 1) // 2) + half
    return (rank - half - t) % half


class ShiftOne(_Undirected):
    """Bagua's ``shift_one``: a perfect matching that shifts by one every round; each pair
    averages (1/2 each), so a rank sends one model per round. An odd world idles one rank a
    round (module docstring)."""

    name = "shift_one"

    @property
    def period(self) -> int:
        return max(1, (self.world_size + self.world_size % 2) // 2)

    def peer(self, t: int, rank: int) -> int | None:
        """``rank``'s partner in round ``t``, None when it sits the round out."""
        n = self.world_size + self.world_size % 2  # an odd world: one rank more, never there
        peer = bagua_shift_one_peer(rank, n, t)
        return None if peer >= self.world_size else peer

    def neighbours(self, t: int, rank: int) -> set[int]:
        peer = self.peer(t, rank)
        return set() if peer is None else {peer}


def sgp_offsets(world_size: int) -> tuple[int, ...]:
    """SGP's phone book of offsets for ``DynamicDirectedExponentialGraph``: +2^k then -2^k
    (mod n) for k = 0 .. floor(log2(n - 1)), repeats dropped; empty on one rank."""
    out: list[int] = []
    for k in range((world_size - 1).bit_length()):  # floor(log2(n - 1)) + 1 powers, exactly
        for offset in (2**k % world_size, -(2**k) % world_size):
            if offset not in out:
                out.append(offset)
    return tuple(out)


class Exponential(Topology):
    """SGP's one-peer time-varying directed exponential graph: in round t every rank keeps 1/2
    and pushes 1/2 to the rank ``sgp_offsets(n)[t mod len]`` ahead (module docstring)."""

    name = "exponential"
    directed = True

    @property
    def period(self) -> int:
        return max(1, len(sgp_offsets(self.world_size)))

    def offset(self, t: int) -> int:
        """How far ahead every rank pushes in round ``t`` (0 on one rank: nobody)."""
        offsets = sgp_offsets(self.world_size)
        return offsets[t % len(offsets)] if offsets else 0

    def column(self, t: int, rank: int) -> dict[int, float]:
        offset = self.offset(t)
        if offset == 0:
            return {rank: 1.0}
        return {rank: 0.5, (rank + offset) % self.world_size: 0.5}


class Explicit(Topology):
    """Any mixing matrices as data: W(t) = ``matrices[t mod len(matrices)]``.

    Args:
        matrices: square matrices of one size; column-stochastic, and symmetric too when
            ``directed`` is False (gossip averaging needs a doubly stochastic W).
        directed: whether the matrices are only column-stochastic (PushSum).

    Raises:
        ValueError: no matrices, matrices of different sizes or not square, a negative
            weight, a column that does not sum to 1, or (undirected) an asymmetric matrix.
    """

    name = "explicit"

    def __init__(self, matrices: Sequence[torch.Tensor], *, directed: bool = True) -> None:
        if not matrices:
            raise ValueError("Explicit needs at least one matrix")
        n = matrices[0].shape[0]
        super().__init__(n)
        self.matrices = [m.detach().to(torch.float64, copy=True).cpu() for m in matrices]
        self.directed = directed
        self.doubly_stochastic = all(
            torch.allclose(
                m.sum(1), torch.ones(n, dtype=m.dtype, device=m.device), atol=STOCHASTIC_ATOL
            )
            for m in self.matrices
        )
        for t, m in enumerate(self.matrices):
            if m.shape != (n, n):
                raise ValueError(f"matrix {t} has shape {tuple(m.shape)}, expected ({n}, {n})")
            if bool((m < 0).any()):
                raise ValueError(f"matrix {t} has a negative weight")
            if not torch.allclose(
                m.sum(0), torch.ones(n, dtype=m.dtype, device=m.device), atol=STOCHASTIC_ATOL
            ):
                raise ValueError(f"matrix {t}'s columns sum to {m.sum(0).tolist()}, not 1")
            if not directed and not torch.equal(m, m.T):
                raise ValueError(f"matrix {t} is not symmetric; pass directed=True for PushSum")

    @property
    def period(self) -> int:
        return len(self.matrices)

    def column(self, t: int, rank: int) -> dict[int, float]:
        col = self.matrices[t % len(self.matrices)][:, rank]
        return {j: float(w) for j, w in enumerate(col.tolist()) if w != 0.0}


#: Topologies by their command-line name.
TOPOLOGIES: dict[str, type[Topology]] = {
    cls.name: cls for cls in (Ring, Torus, ShiftOne, Exponential)
}

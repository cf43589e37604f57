"""A lower bound on a step's time from its dependency graph and the machine its ranks share.

Every rank of an SPMD step runs the same chain of work. Where ``P`` ranks share ``N`` cores (the
emulated cluster; processor sharing: a core serves one rank at a time, a rank's computation
runs on one intra-op thread), two bounds hold for any schedule:

1. the **machine floor** ``F = W / N``: the cores must do all the ranks' CPU work ``W``
   (``bench/cpu_floor.py`` measures it, with the kernel's network work and the cores other
   programs take);
2. the **critical path** of one rank: its computation ``c`` on one core, ``T >= c``.

Both let work fill any gap. The step's graph does not, at its **global waits**: an exchange
after which every rank's next work needs data from every rank (an All-to-All whose pieces are
awaited piece-major, an all-reduce). Let ``t`` be the moment the last rank has posted its part;
no rank's dependent work starts before ``t + w``, where ``w`` is the exchange's shortest wait
(its time alone; at ``k`` pieces awaited piece-major, its first piece round, ``w / k``). Inside
``[t, t + w]`` only the wait's **fill** can run: work the graph lets run beside the exchange (an
expert GEMM's local block, which needs no remote row; the update of parameters the exchange
does not carry), plus the exchange's own CPU, at most ``rho`` cores while its bytes move
(``rho``: its CPU over its time alone, the CPU of each byte being spent as it moves). The waits
lie in the chain one after another, so their windows are disjoint. Over ``[0, T]`` the cores
give ``N T``: the work ``W``, and in each window at least ``N w - rho w - fill`` of idle
capacity. Hence, for a wait ``i`` of length ``w_i``:

    T >= F + sum_i max(0, w_i (1 - rho_i / N) - fill_i / N)         (the machine)
    T >= c + sum_i max(0, w_i - fill_i / P)                         (one rank, one core)

Design notes: ``docs/simulator.md``, "The step's lower bound: what it counts and leaves out".
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlobalWait:
    """A wait the step's graph imposes on every rank at once (module docstring)."""

    name: str
    """What is awaited (``dispatch``, ``all-reduce``)."""
    wait_us: float
    """Its shortest length in one piece: the exchange's time alone (wall, us)."""
    chunked: bool = False
    """Awaited piece-major: at ``k`` pieces every rank waits for the first round only,
    ``wait_us / k``."""
    fill_us: float = 0.0
    """Core time (us, all ranks) of the work the graph lets run during the wait."""
    traffic_cores: float = 0.0
    """Cores the exchange's own CPU takes while its bytes move: its CPU (all ranks) over its
    time alone."""

    def __post_init__(self) -> None:
        if min(self.wait_us, self.fill_us, self.traffic_cores) < 0:
            raise ValueError(f"wait {self.name!r}: wait_us, fill_us and traffic_cores must be >= 0")

    @classmethod
    def alone(cls, name: str, wall_us: float, cpu_us: float, **kw: Any) -> GlobalWait:
        """The wait of an exchange timed alone: its wall time ``wall_us``, and its CPU
        ``cpu_us`` (all ranks) over that time as the cores its traffic takes."""
        return cls(name=name, wait_us=wall_us, traffic_cores=cpu_us / max(wall_us, 1.0), **kw)

    def length_us(self, chunks: int) -> float:
        """The wait at ``chunks`` pieces."""
        return self.wait_us / chunks if self.chunked else self.wait_us


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepGraph:
    """What the bound needs of a step: its floors, its global waits and its chunk choices."""

    ranks: int
    """Ranks sharing the machine's cores (``P``)."""
    cores: float
    """Cores left to the ranks (``N``: the machine's, less those other programs take)."""
    floor_us: float
    """The machine floor ``F``: every rank's CPU (and the kernel's network work) over ``cores``."""
    rank_compute_us: float
    """One rank's computation (the mean rank's CPU of the step's compute, us)."""
    waits: tuple[GlobalWait, ...] = ()
    """The step's global waits, in any order."""
    chunk_choices: tuple[int, ...] = (1,)
    """The chunk counts the operator allows."""
    piece_cpu_us: float = 0.0
    """CPU (us, all ranks) each piece beyond the first costs; 0: none counted."""

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.cores <= 0:
            raise ValueError(f"need ranks >= 1 and cores > 0, got {self.ranks}, {self.cores}")
        if not self.chunk_choices or min(self.chunk_choices) < 1:
            raise ValueError(f"chunk_choices must be counts >= 1, got {self.chunk_choices}")
        if min(self.floor_us, self.rank_compute_us, self.piece_cpu_us) < 0:
            raise ValueError("floor_us, rank_compute_us and piece_cpu_us must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBound:
    """The bound and how it is made (at the chunk count that gives it)."""

    bound_us: float
    """``max(machine_us, critical_path_us)`` at ``chunks``: the least over the choices."""
    chunks: int
    """The chunk count that gives the bound (the fewest, where several do)."""
    machine_us: float
    """The machine floor, the pieces' CPU and each wait's idle cores, over the cores."""
    critical_path_us: float
    """One rank's computation and what of each wait its own fill leaves."""
    exposed_us: dict[str, float]
    """Each wait's idle cores over the cores (us of the step), at ``chunks``."""


def _machine_exposed_us(wait: GlobalWait, chunks: int, cores: float) -> float:
    """The idle core time a wait forces, over the cores: ``max(0, w (1 - rho / N) - fill / N)``."""
    w = wait.length_us(chunks)
    return max(0.0, w * (1 - min(wait.traffic_cores, cores) / cores) - wait.fill_us / cores)


def step_bound(graph: StepGraph) -> StepBound:
    """The least over ``graph.chunk_choices`` of ``max(machine, one rank)`` (module docstring)."""
    best: StepBound | None = None
    for k in sorted(set(graph.chunk_choices)):
        exposed = {w.name: _machine_exposed_us(w, k, graph.cores) for w in graph.waits}
        pieces = (k - 1) * graph.piece_cpu_us / graph.cores
        machine = graph.floor_us + pieces + sum(exposed.values())
        path = graph.rank_compute_us + sum(
            max(0.0, w.length_us(k) - w.fill_us / graph.ranks) for w in graph.waits
        )
        bound = max(machine, path)
        if best is None or bound < best.bound_us:
            best = StepBound(
                bound_us=bound,
                chunks=k,
                machine_us=machine,
                critical_path_us=path,
                exposed_us=exposed,
            )
    assert best is not None  # StepGraph requires a chunk choice
    return best

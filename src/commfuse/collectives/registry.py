"""The table of algorithms: ``ALGORITHMS[collective][name] -> function``.

Every algorithm is a plain synchronous function over a Communicator that works on flat,
contiguous tensors; the front door (``api.py``) flattens, validates, picks the algorithm and
runs it synchronously or on the communicator's worker thread. The signatures, per collective:

=============== =============================================================================
all_reduce      ``fn(comm, buf, op, **opts)``: ``buf`` reduced in place on every rank
broadcast       ``fn(comm, buf, root, **opts)``: root's ``buf`` copied into every ``buf``
reduce          ``fn(comm, buf, root, op, **opts)``: reduction into root's ``buf``; other
                ranks' ``buf`` left unchanged
all_gather      ``fn(comm, out, inp, **opts)``: ``out`` (world x numel(inp)) = every ``inp`` in
                rank order
reduce_scatter  ``fn(comm, out, inp, op, **opts)``: ``out`` on rank r = reduction of block r of
                every ``inp`` (``inp`` is world x numel(out), left unchanged)
all_to_all      ``fn(comm, out, inp, out_splits, in_splits, **opts)``: block j of ``inp`` to
                rank j; block i of ``out`` from rank i (splits in elements)
=============== =============================================================================

``opts`` are algorithm-specific keywords (``block_bytes`` for pipelines, ``ranks_per_host`` for
hierarchical ones); an algorithm ignores the ones it does not know (``**_``). Each algorithm
labels its point-to-point traffic with ``label=f"{collective}.{name}"`` so tests can assert
the bytes and messages it sent against its formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

#: A collective's name, as torch spells it.
Collective = Literal[
    "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"
]
COLLECTIVES: tuple[Collective, ...] = get_args(Collective)

AlgorithmFn = Callable[..., None]
ALGORITHMS: dict[str, dict[str, AlgorithmFn]] = {name: {} for name in COLLECTIVES}
"""Every registered algorithm: collective -> algorithm name -> its function (``register``
adds one; ``algorithms_for`` loads the families first)."""


def register(collective: Collective, name: str) -> Callable[[AlgorithmFn], AlgorithmFn]:
    """Decorator: add ``fn`` as algorithm ``name`` of ``collective``."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}")

    def add(fn: AlgorithmFn) -> AlgorithmFn:
        if name in ALGORITHMS[collective]:
            raise ValueError(f"{collective} algorithm {name!r} registered twice")
        ALGORITHMS[collective][name] = fn
        return fn

    return add


def label(collective: str, name: str) -> str:
    """The stats/trace kind of an algorithm's point-to-point traffic."""
    return f"{collective}.{name}"


#: Short names (the literature's and MPI folklore's) accepted wherever an algorithm is named.
_ALIASES: dict[str, str] = {
    "lp": "pipeline",
    "rd": "doubling",
    "rab": "rabenseifner",
    "hier": "hierarchical",
    "mst": "tree",
}
#: Where a short name means a different member of the family for one collective.
_ALIASES_BY_COLLECTIVE: dict[tuple[str, str], str] = {
    ("reduce_scatter", "rab"): "halving",
    ("reduce_scatter", "rh"): "halving",
}


def resolve(collective: str, name: str) -> str:
    """The registered name behind ``name`` (itself, or what an alias stands for)."""
    return _ALIASES_BY_COLLECTIVE.get((collective, name), _ALIASES.get(name, name))


def algorithms_for(collective: str) -> dict[str, AlgorithmFn]:
    """The algorithms of ``collective`` (``"all_reduce"``, ...) by name, every family loaded."""
    _load_families()
    return ALGORITHMS[collective]


def check_algorithm(collective: str, algo: str, *, key: str = "algo") -> None:
    """ValueError unless ``algo`` is ``auto`` or names (or aliases) a registered algorithm of
    ``collective``; the message starts ``{key}='...'`` (for settings checked before any run)."""
    if algo == "auto":
        return
    known = algorithms_for(collective)
    if resolve(collective, algo) not in known:
        raise ValueError(
            f"{key}={algo!r} is not an {collective} algorithm: use auto or one of "
            f"{', '.join(sorted(known))}"
        )


_loaded = False


def _load_families() -> None:
    """Import every family module once, so its @register calls run."""
    global _loaded
    if _loaded:
        return
    import importlib

    for module in _FAMILY_MODULES:
        importlib.import_module(module)
    _loaded = True


#: One module per family of algorithms (docs/design.md: one concept per file).
_FAMILY_MODULES: tuple[str, ...] = (
    "commfuse.collectives.native",
    "commfuse.collectives.ring",
    "commfuse.collectives.doubling",
    "commfuse.collectives.pairwise",
    "commfuse.collectives.pipeline",
    "commfuse.collectives.tree",
    "commfuse.collectives.hierarchical",
)

Options = dict[str, Any]

"""The public entry points document themselves: ``Args:``, ``Returns:``, ``Raises:`` and an
example, as PyTorch's and torchtitan's do, and their modules teach without this machine's
milliseconds.

The API reference (``docs/api/``) is built from these docstrings by mkdocstrings, so what is
checked here is what a user reads there.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "commfuse"

#: The front door of each part: ``module:name`` (a class's constructor is checked on the class).
ENTRY_POINTS = [
    "commfuse.collectives:all_reduce",
    "commfuse.collectives:broadcast",
    "commfuse.collectives:reduce",
    "commfuse.collectives:all_gather",
    "commfuse.collectives:reduce_scatter",
    "commfuse.collectives:all_to_all",
    "commfuse.comm:Communicator",
    "commfuse.comm:CommConfig",
    "commfuse.ddp:DataParallel",
    "commfuse.ddp:DataParallelConfig",
    "commfuse.localsgd:PeriodicSyncOptimizer",
    "commfuse.decentral:GossipAveraging",
    "commfuse.decentral:PushSum",
    "commfuse.hooks:CompressionState",
    "commfuse.hooks:compressed_allreduce_hook",
    "commfuse.fused:ColumnParallelLinear",
    "commfuse.fused:RowParallelLinear",
    "commfuse.fused:ShardedEmbeddingBag",
    "commfuse.fused:ExpertParallelMoE",
    "commfuse.fused.linear_attention:causal_linear_attention",
    "commfuse.fused.lasp:lasp",
    "commfuse.fused.lasp2:lasp2",
    "commfuse.sim:simulate_step",
    "commfuse.pipeline:PipelineRuntime",
    "commfuse.pipeline:one_f_one_b",
    "commfuse.cluster:run",
]


def entry(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def has_parameters(obj: Any) -> bool:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    return any(p.name not in {"self", "cls"} for p in signature.parameters.values())


@pytest.mark.parametrize("spec", ENTRY_POINTS)
def test_entry_point_has_args_returns_raises_and_an_example(spec: str) -> None:
    obj = entry(spec)
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and not dataclass_like(obj):
        doc += "\n" + (inspect.getdoc(obj.__init__) or "")
    missing = []
    if dataclass_like(obj):
        missing += [f"a docstring for field {f}" for f in undocumented_fields(obj)]
    elif has_parameters(obj) and "Args:" not in doc:
        missing.append("Args:")
    if not inspect.isclass(obj) and "Returns:" not in doc:
        missing.append("Returns:")
    if "Raises:" not in doc:
        missing.append("Raises:")
    if "Example" not in doc:
        missing.append("Example")
    assert not missing, f"{spec}'s docstring lacks {', '.join(missing)}"


def dataclass_like(obj: Any) -> bool:
    return inspect.isclass(obj) and hasattr(obj, "__dataclass_fields__")


def undocumented_fields(cls: type) -> list[str]:
    """Init fields of a dataclass without the docstring under them (what mkdocstrings shows)."""
    import ast
    import textwrap

    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    documented = set()
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            documented.add(stmt.target.id)
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return [name for name, f in fields.items() if f.init and name not in documented]


#: A measured time of this machine in a module docstring ("35 ms", "1.2 s on 4 ranks").
MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us)\b")


def test_module_docstrings_hold_no_measurements_of_this_machine() -> None:
    import ast

    found = []
    for path in sorted(SRC.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for line in doc.splitlines():
            if MEASUREMENT.search(line) and "clock tick" not in line:  # a unit, not a timing
                found.append(f"{path.relative_to(SRC)}: {line.strip()}")
    assert not found, "measurements belong in benchmarks/ reports:\n" + "\n".join(found)


#: The most lines a module docstring may have: the title, the paper, the numbered steps and the
#: cost; the design rationale goes to the part's page in ``docs/`` (``docs/design.md``, "Where
#: text goes"), which the docstring links.
MAX_MODULE_DOCSTRING_LINES = 30

#: Modules whose docstrings are still longer, each being shortened by the change that owns the
#: module. This list only ever shrinks: remove a path when its docstring fits, never add one.
LONG_DOCSTRINGS_BEING_SHORTENED: frozenset[str] = frozenset()


def module_docstring_lines(path: Path) -> int:
    """Lines of the module docstring of ``path`` (0 without one), blank lines included."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return len(doc.strip().splitlines()) if doc else 0


def test_module_docstrings_are_at_most_30_lines() -> None:
    lengths = {p.relative_to(SRC).as_posix(): module_docstring_lines(p) for p in SRC.rglob("*.py")}
    long = {
        path: n
        for path, n in sorted(lengths.items())
        if n > MAX_MODULE_DOCSTRING_LINES and path not in LONG_DOCSTRINGS_BEING_SHORTENED
    }
    assert not long, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (keep the title, the paper, "
        f"the steps and the cost; move the rationale to docs/ and link it): {long}"
    )
    fixed = sorted(
        path
        for path in LONG_DOCSTRINGS_BEING_SHORTENED
        if lengths.get(path, 0) <= MAX_MODULE_DOCSTRING_LINES
    )
    assert not fixed, f"remove from LONG_DOCSTRINGS_BEING_SHORTENED, they fit now: {fixed}"

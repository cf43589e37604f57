"""Every import inside ``src/commfuse`` goes down the layer order of ``docs/design.md``, never up.

``docs/design.md`` ("The floors") explains the table below, draws it, and says where each kind
of change goes; a change to ``LAYERS`` changes that page too.

Each folder (or top-level module) of the package has a layer; a module may import its own
folder and anything on a lower layer, never a higher one. Imports inside functions count (a
lazy import is still a dependency, only a later one), and so does
``importlib.import_module("commfuse....")`` with a literal name. The table states the order:

=====  ==========================================  ==============================================
layer  folders                                     what they are
=====  ==========================================  ==============================================
0      ``units``, ``lazy``, ``cluster``, the root  sizes and rates; lazy names; where ranks run
1      ``comm``                                    the transport every algorithm uses
2      ``collectives``                             algorithms over ``comm``, costs, the tuner
3      ``fused``, ``compress``                     compute+collective operators; compressors
3      ``sim``                                     the simulator: cost models only (see SIM_MAY)
3      ``pipeline``                                pipeline schedules as data; their runtime
4      ``ddp``, ``localsgd``, ``hooks``            training engines over layers 2-3
4      ``optim``                                   optimizers that communicate (1-bit Adam)
4      ``decentral``                               gossip and PushSum over topologies as data
5      ``workloads``                               models and data sets
6      ``train``, ``ft``                           training runs and their records; torchft
6      ``integrations``                            adapters for Lightning, Accelerate, ...
7      ``bench``                                   measuring and reporting: rounds, ratios, tables
8      ``cli``                                     the ``commfuse`` command
9      ``testing``                                 test helpers: nothing in the package imports it
=====  ==========================================  ==============================================

The simulator predicts clusters far larger than the machine, so its model reuses
``collectives``' cost formulas, registry and tuner and nothing that needs a process group: the
whole folder may import only ``SIM_MAY``. What runs real jobs to calibrate and check it
(``bench/sim_measure.py``, ``bench/sim_validate.py``) measures, so it sits in ``bench``; what
turns a training strategy into the model's plan (``train/sim_plan.py``) sits with the strategies.
Folders of one layer may import each other, but the folder graph has no cycle.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "commfuse"

#: The layer of each folder or top-level module of ``commfuse`` (the module docstring's table).
LAYERS: dict[str, int] = {
    "__init__": 0,
    "units": 0,
    "lazy": 0,
    "cluster": 0,
    "comm": 1,
    "collectives": 2,
    "fused": 3,
    "compress": 3,
    "sim": 3,
    "pipeline": 3,
    "ddp": 4,
    "localsgd": 4,
    "hooks": 4,
    "optim": 4,
    "decentral": 4,
    "workloads": 5,
    "train": 6,
    "ft": 6,
    "integrations": 6,
    "bench": 7,
    "cli": 8,
    "testing": 9,
}
#: What the simulator's model may import besides itself.
SIM_MAY = frozenset({"units", "lazy", "collectives"})


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of a ``commfuse`` module: where it is and what it names."""

    path: str
    """The importing file, relative to the package (``ddp/reducer.py``)."""
    line: int
    target: str
    """The imported module's dotted name (``commfuse.collectives.ring``)."""

    @property
    def part(self) -> str:
        """The imported folder or top-level module (``collectives``)."""
        names = self.target.split(".")
        return names[1] if len(names) > 1 else "__init__"


def package_parts(root: Path) -> set[str]:
    """The folders and top-level modules of the package at ``root``."""
    return {p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every import of a ``commfuse`` module in ``path`` (a file of the package at ``root``), at
    any depth of the syntax tree."""
    rel = path.relative_to(root)
    names = ["commfuse", *rel.with_suffix("").parts]
    package = names[:-1]  # what a relative import starts from (``__init__``'s own package)
    parts = package_parts(root)
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module == "commfuse":  # ``from commfuse import collectives``: the submodule
                targets = [
                    f"commfuse.{alias.name}" if alias.name in parts else module
                    for alias in node.names
                ]
            else:
                targets = [module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        found += [
            Import(rel.as_posix(), node.lineno, t)  # type: ignore[attr-defined]  # every node here has a line
            for t in targets
            if t == "commfuse" or t.startswith("commfuse.")
        ]
    return found


def layer_of(path: str) -> tuple[str, int]:
    """(folder or top-level module, layer) of a file relative to the package."""
    part = path.split("/")[0].removesuffix(".py")
    return part, LAYERS[part]


def folder_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Which folders (and top-level modules) each one imports, its own left out."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for imp in imports_of(root, path):
            part = imp.path.split("/")[0].removesuffix(".py")
            if imp.part != part:
                graph.setdefault(part, set()).add(imp.part)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each folder that is on one (``a -> b -> a``), by depth-first search."""
    found: list[list[str]] = []
    on_cycle: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = [*path[path.index(nxt) :], nxt]
                if not on_cycle.issuperset(cycle):
                    found.append(cycle)
                    on_cycle.update(cycle)
            else:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def violations(root: Path = PACKAGE) -> list[str]:
    """Every import in the package at ``root`` that breaks the layer order, one line each."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        for imp in imports_of(root, path):
            part, layer = layer_of(imp.path)
            if imp.part == part:
                continue
            where = f"{imp.path}:{imp.line} imports {imp.target}"
            if imp.part not in LAYERS:
                problems.append(f"{where}: {imp.part!r} has no layer in LAYERS")
            elif LAYERS[imp.part] > layer:
                problems.append(
                    f"{where}: up the layer order ({part} is layer {layer}, "
                    f"{imp.part} layer {LAYERS[imp.part]})"
                )
            elif part == "sim" and imp.part not in SIM_MAY:
                problems.append(f"{where}: the simulator's model may import only {sorted(SIM_MAY)}")
    return problems


def test_every_folder_has_a_layer() -> None:
    assert package_parts(PACKAGE) - set(LAYERS) == set()


def test_imports_run_down_the_layer_order() -> None:
    assert violations() == []


def test_no_folder_imports_itself_through_others() -> None:
    """Folders of one layer may import each other, but never both ways round."""
    assert cycles(folder_graph()) == []


def test_a_cycle_between_folders_is_found() -> None:
    graph = {"ddp": {"comm", "localsgd"}, "localsgd": {"optim"}, "optim": {"ddp"}, "comm": set()}
    assert cycles(graph) == [["ddp", "localsgd", "optim", "ddp"]]
    assert cycles({"ddp": {"comm"}, "localsgd": {"comm", "ddp"}}) == []


def test_an_upward_import_in_any_form_is_found(tmp_path: Path) -> None:
    """The check itself: a ``comm`` module reaching up to ``ddp`` in each way Python allows,
    at module level or inside a function, is reported once per import."""
    root = tmp_path / "commfuse"
    for folder in ("comm", "ddp", "sim", "collectives"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "comm" / "x.py").write_text(
        "import commfuse.ddp\n"
        "from commfuse import ddp, __version__\n"
        "from ..ddp import wrapper\n"
        "from . import y\n"  # its own folder: fine
        "from commfuse.collectives import cost\n"  # up: collectives is layer 2
        "def later():\n"
        "    from commfuse.ddp.reducer import Reducer\n"
        "    import importlib\n"
        "    return importlib.import_module('commfuse.ddp.merge')\n"
    )
    (root / "sim" / "model.py").write_text("from commfuse.comm import Communicator\n")
    (root / "ddp" / "ok.py").write_text("from commfuse.comm import x\nfrom ..sim import model\n")
    found = violations(root)
    lines = sorted(int(v.split(":")[1].split()[0]) for v in found if v.startswith("comm/x.py"))
    assert lines == [1, 2, 3, 5, 7, 9], found
    assert any(v.startswith("sim/model.py:1 ") and "may import only" in v for v in found), found
    assert not any(v.startswith("ddp/") for v in found), found

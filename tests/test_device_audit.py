"""Every tensor commfuse allocates lands on the caller's device.

A rank on a GPU hands commfuse CUDA tensors; a buffer made with a bare ``torch.zeros(n)`` would
sit on the CPU and NCCL would refuse it (or, worse, the CPU would silently do the GPU's work).
This test reads ``src/commfuse`` with ``ast`` and fails on any call of a tensor factory without
a ``device=`` keyword. The forms that follow their input by construction (``torch.zeros_like``,
``tensor.new_zeros``, ``tensor.new_empty``, ...) are not factories here and need nothing.

A draw from a seeded CPU generator says ``device="cpu"`` and moves its result (``.to(device)``):
every device then sees the same numbers, and the explicit keyword states that choice.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import commfuse

SRC = Path(commfuse.__file__).resolve().parent

#: ``torch.<name>(...)`` calls that allocate a new tensor on the default (CPU) device unless told.
FACTORIES = frozenset(
    {
        "zeros",
        "empty",
        "ones",
        "full",
        "tensor",
        "arange",
        "rand",
        "randn",
        "randint",
        "randperm",
        "eye",
        "linspace",
        "as_tensor",
        "from_numpy",
        "empty_strided",
        "logspace",
        "scalar_tensor",
        "triu_indices",
        "tril_indices",
    }
)

#: (file under src/commfuse, enclosing function as ``Class.method`` or ``<module>``) where a
#: tensor on the CPU is the point. Keep it short: every entry says why.
ALLOWED: dict[tuple[str, str], str] = {
    # A NumPy RNG state is host memory by definition (checkpoints restore it on the host).
    ("train/checkpoint.py", "numpy_rng_to_dict"): "RNG state lives on the host",
    # The pool's health probe runs on the gloo groups the tests keep warm (CPU only).
    ("testing/pool.py", "_group_healthy"): "test helper on gloo groups",
    # The simulator calibrates this machine's CPU and gloo links into a cost model; its
    # micro-benchmarks measure the host, not a caller's tensors.
    ("bench/sim_measure.py", "_slowest"): "simulator calibration on the host",
    ("bench/sim_measure.py", "_collective"): "simulator calibration on the host",
    ("bench/sim_measure.py", "_p2p"): "simulator calibration on the host",
    ("bench/sim_measure.py", "_local"): "simulator calibration on the host",
    ("bench/sim_measure.py", "_step"): "simulator calibration on the host",
    # The bundled corpus is decoded once at import into host tensors; batches move later.
    ("workloads/corpus.py", "<module>"): "dataset decoded on the host",
    # The digits dataset is loaded from its bundled files into host tensors.
    ("workloads/digits.py", "load_split_tensors"): "dataset loaded on the host",
}


class _FactoryCalls(ast.NodeVisitor):
    """Collects (function, line, factory) of the bare factory calls of one module."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
            and func.attr in FACTORIES
            and not any(kw.arg == "device" for kw in node.keywords)
        ):
            where = ".".join(self.scope) or "<module>"
            self.found.append((where, node.lineno, f"torch.{func.attr}"))
        self.generic_visit(node)


def _violations() -> list[tuple[str, str, int, str]]:
    """(file, function, line, factory) for every factory call without ``device=``."""
    found: list[tuple[str, str, int, str]] = []
    for path in sorted(SRC.rglob("*.py")):
        visitor = _FactoryCalls()
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        rel = path.relative_to(SRC).as_posix()
        found += [(rel, where, line, call) for where, line, call in visitor.found]
    return found


def test_every_factory_names_its_device() -> None:
    bad = [v for v in _violations() if (v[0], v[1]) not in ALLOWED]
    listing = "\n".join(f"  {f}:{line} in {fn}: {call}(...)" for f, fn, line, call in bad)
    assert not bad, (
        "tensor factories without device= (pass the input's device, comm.device, or use "
        f"*_like / new_*):\n{listing}"
    )


def test_allow_list_is_short_and_current() -> None:
    # Every entry still matches a call (a stale entry would silently allow a new one later).
    assert len(ALLOWED) <= 20
    used = {(f, fn) for f, fn, _, _ in _violations()}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries with no factory call left: {stale}"


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("import torch\ndef f(n):\n    return torch.zeros(n)\n", True),
        ("import torch\ndef f(x):\n    return torch.zeros(3, device=x.device)\n", False),
        ("import torch\ndef f(x):\n    return torch.zeros_like(x)\n", False),
        ("import torch\ndef f(x):\n    return x.new_zeros(3)\n", False),
        ("import torch\nclass A:\n    def g(self):\n        return torch.randn(2)\n", True),
    ],
)
def test_the_audit_sees_a_bare_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, flagged: bool
) -> None:
    # The walker itself can fail: a bare factory in a file of its tree is reported.
    (tmp_path / "mod.py").write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", tmp_path)
    assert bool(_violations()) is flagged

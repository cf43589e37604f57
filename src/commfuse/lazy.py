"""A package's public names, imported on first use (PEP 562), so importing the package is cheap.

The pattern of Scientific Python's ``lazy_loader.attach`` (SPEC 1): the package's
``__init__.py`` lists which module defines each public name and sets
``__getattr__, __dir__ = attach(__name__, names)``. Reading a name the first time imports its
module and stores the value on the package, so later reads are plain attribute lookups. Type
checkers see the names through the same imports under ``if TYPE_CHECKING:``.

commfuse uses it where a package's cheap parts (cost models, configs, errors) must not pay for
the parts that import torch: the simulator and ``commfuse --help`` run without torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def attach(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each of ``names`` (public name -> the module
    that defines it; a submodule of the package maps to itself, ``"sim": "commfuse.sim"``) is
    imported when first read."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = names[name]
        module = importlib.import_module(target)
        value = module if target == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__

"""The linters and the type checker run as part of the test command, so ``pytest -q`` (the
README's and CI's command) checks everything the project claims: ``ruff check``,
``ruff format --check`` and ``mypy`` (strict, configured in ``pyproject.toml``).

A tool that is not installed skips its test with the reason, except under ``CI=true``, where a
missing tool is a failure (CI installs ``.[dev]``, so a missing tool there is a broken setup,
not a reason to pass).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What the tools look at: the package and its tests (mypy's own list is in pyproject.toml).
PATHS = ["src", "tests"]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def tool(name: str) -> list[str]:
    """The command that runs ``name``: the one installed beside this Python (the venv's), then
    the module, then the PATH's; skips (fails under CI) when there is none."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    if importlib.util.find_spec(name) is not None:
        return [sys.executable, "-m", name]
    found = shutil.which(name)
    if found:
        return [found]
    reason = f"{name} is not installed (pip install -e '.[dev]')"
    if in_ci():
        pytest.fail(f"{reason}; under CI=true every check must run")
    pytest.skip(reason)


def check(command: list[str]) -> None:
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, (
        f"`{' '.join(command)}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )


def test_ruff_check() -> None:
    check([*tool("ruff"), "check", *PATHS])


def test_ruff_format() -> None:
    check([*tool("ruff"), "format", "--check", *PATHS])


def test_mypy_strict() -> None:
    # The files, strictness and paths come from [tool.mypy] in pyproject.toml.
    check([*tool("mypy")])

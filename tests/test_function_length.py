"""No function in ``src/`` is longer than ``MAX_LINES`` lines unless it says why.

A function's length counts every line from its ``def`` (or first decorator) to its last
line, docstring included, as ``ast`` gives them (``end_lineno - lineno + 1``, nested
functions inside it counted with it). A longer function must carry, in the comment block
directly above its ``def`` (or its first decorator), a line::

    # long because: <why splitting it would make it harder to read>

Split a long function where its parts have names of their own (an object with methods, as
``ft/loop.py``'s ``ReplicaLoop``); keep it whole, with that comment, only where reading it
top to bottom is the point (a benchmark's timed sequence, say).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 120
REASON = "# long because:"


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[tuple[Path, str, int, int]]:
    """``(file, name, first line, length)`` of every function under ``root`` longer than
    ``max_lines`` whose comment block above it has no ``# long because:`` line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            if length > max_lines and not _says_why(lines, first):
                found.append((path, node.name, first, length))
    return found


def _says_why(lines: list[str], first: int) -> bool:
    """Whether the comment lines right above line ``first`` (1-based) hold ``REASON``."""
    index = first - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        if lines[index].strip().startswith(REASON):
            return True
        index -= 1
    return False


def test_no_function_over_the_limit_without_a_reason() -> None:
    found = long_functions(SRC)
    assert not found, "functions over {} lines without a '{}' comment above them:\n{}".format(
        MAX_LINES,
        REASON,
        "\n".join(
            f"  {path.relative_to(SRC.parent)}:{line} {name} ({length} lines)"
            for path, name, line, length in found
        ),
    )


def test_the_check_finds_a_long_function_and_accepts_its_reason(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "bare.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    (tmp_path / "why.py").write_text(
        f"# A comment block above it.\n{REASON} one sequence, read in order\n@staticmethod\n"
        f"def long():\n{body}"
    )
    found = long_functions(tmp_path)
    assert [(path.name, name, line, length) for path, name, line, length in found] == [
        ("bare.py", "long", 1, MAX_LINES + 1)
    ]

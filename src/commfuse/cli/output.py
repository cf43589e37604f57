"""Writing a command's output files at the end of a run: every file a command writes
(``--json``, ``--markdown``, ``--plot``, ``--trace``, ``--save-cluster``, ``--save-profile``).

``output_path`` (``common.py``) checks the path as the command line is read, but the file
system can still refuse at the end (it went read-only, the directory went away; as root the
up-front check passes on a read-only mount). A run of minutes must not lose its record then:

1. the file is written to a temporary file beside the path (its name ends as the path's, so a
   plot keeps its format), which then replaces the path in one ``os.replace`` (a reader never
   sees half a file, a failed write leaves the old one);
2. where that fails, it goes to a new file in the system's temporary directory (else the
   current one), named after the path, and stderr says where; the command then exits 1;
3. where no file can be written, a text goes to stdout (``write_output``); a plot is lost,
   and stderr says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

_Writer = Callable[[Path], object]
"""Writes a whole output file at the path it is given (``Path.write_text``, a ``savefig``)."""


def _write_beside(path: Path, write: _Writer, folder: Path) -> Path:
    """``write`` a new file in ``folder`` and rename it to ``path`` (``folder`` is ``path``'s
    own) or keep its unique name (another folder); the file's mode is what ``open`` would
    give a new file (the umask's)."""
    beside = folder == path.parent
    fd, temporary = tempfile.mkstemp(
        prefix=f".{path.stem}-" if beside else f"{path.stem}-", suffix=path.suffix, dir=folder
    )
    try:
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
        finally:
            os.close(fd)  # ``write`` opens the file by its name (a plot's ``savefig`` does)
        write(Path(temporary))
        if not beside:
            return Path(temporary)
        os.replace(temporary, path)
        return path
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_file(args: argparse.Namespace, path: str, write: _Writer) -> str | None:
    """Write the output file ``path`` with ``write`` (see the module docstring for what
    happens when it cannot be written); return where it went, None where nowhere.

    A fallback marks ``args.outputs_moved``, so that ``run_command`` exits 1 even when the
    command succeeded. An error of ``write`` other than the file system's (``OSError``)
    propagates, and no file is left behind.

    Args:
        args: the command's parsed arguments (``prog`` names it in the message).
        path: the path the user gave.
        write: writes the whole file at the path it is given.

    Example:
        ```python
        written = write_file(args, args.plot, lambda p: plot_curve(records, p))
        if written is not None:
            print(f"plot written to {written}")
        ```
    """
    return _write_somewhere(args, path, write, nowhere="it is lost")


def _write_somewhere(
    args: argparse.Namespace, path: str, write: _Writer, *, nowhere: str
) -> str | None:
    """``write_file``; ``nowhere`` ends the message when no file could be written."""
    target = Path(path).expanduser()
    try:
        return str(_write_beside(target, write, target.parent))
    except OSError as err:
        reason = f"{err.strerror or type(err).__name__}"
    prog = getattr(args, "prog", "commfuse")
    args.outputs_moved = True
    for folder in (Path(tempfile.gettempdir()), Path.cwd()):
        try:
            written = _write_beside(target, write, folder)
        except OSError:
            continue
        print(f"{prog}: cannot write {path} ({reason}); wrote it to {written}", file=sys.stderr)
        return str(written)
    print(f"{prog}: cannot write {path} ({reason}) nor any file: {nowhere}", file=sys.stderr)
    return None


def write_output(args: argparse.Namespace, path: str, text: str) -> str:
    """Write ``text`` to the output file ``path`` (``write_file``); where no file can be
    written, to stdout. Returns where it went (``"stdout"`` as the last resort).

    Args:
        args: the command's parsed arguments (``prog`` names it in the message).
        path: the path the user gave.
        text: the file's whole contents.

    Example:
        ```python
        written = write_output(args, args.json, json.dumps(record, indent=1) + "\\n")
        print(f"metrics written to {written}")
        ```
    """
    written = _write_somewhere(args, path, lambda file: file.write_text(text), nowhere="here it is")
    if written is not None:
        return written
    sys.stdout.write(text)
    return "stdout"

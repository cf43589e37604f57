"""Writing a command's output file (``--json``, ``--markdown``) at the end of a run.

``output_path`` (``common.py``) checks the path as the command line is read, but the file
system can still refuse at the end (it went read-only, the directory went away; as root the
up-front check passes on a read-only mount). A run of minutes must not lose its record then:

1. the text goes to a temporary file beside the path, which then replaces the path in one
   ``os.replace`` (a reader never sees half a file, a failed write leaves the old one);
2. where that fails, the text goes to a new file in the system's temporary directory (else
   the current one), named after the path, and stderr says where; the command then exits 1;
3. where no file can be written, the text goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


def _write_beside(path: Path, text: str, folder: Path) -> Path:
    """Write ``text`` to a new file in ``folder`` and rename it to ``path`` (``folder`` is
    ``path``'s own) or keep its unique name (another folder); the file's mode is what
    ``open`` would give a new file (the umask's)."""
    fd, temporary = tempfile.mkstemp(
        prefix=f".{path.name}." if folder == path.parent else f"{path.stem}-",
        suffix=".tmp" if folder == path.parent else path.suffix,
        dir=folder,
    )
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if folder != path.parent:
            return Path(temporary)
        os.replace(temporary, path)
        return path
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_output(args: argparse.Namespace, path: str, text: str) -> str:
    """Write ``text`` to the output file ``path`` (see the module docstring for what happens
    when it cannot be written); return where it went (``"stdout"`` as the last resort).

    A fallback marks ``args.outputs_moved``, so that ``run_command`` exits 1 even when the
    command succeeded.

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
    target = Path(path).expanduser()
    try:
        return str(_write_beside(target, text, target.parent))
    except OSError as err:
        reason = f"{err.strerror or type(err).__name__}"
    prog = getattr(args, "prog", "commfuse")
    args.outputs_moved = True
    for folder in (Path(tempfile.gettempdir()), Path.cwd()):
        try:
            written = _write_beside(target, text, folder)
        except OSError:
            continue
        print(f"{prog}: cannot write {path} ({reason}); wrote it to {written}", file=sys.stderr)
        return str(written)
    print(f"{prog}: cannot write {path} ({reason}) nor any file: here it is", file=sys.stderr)
    sys.stdout.write(text)
    return "stdout"

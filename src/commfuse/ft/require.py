"""The optional dependency: torchft, installed by ``pip install commfuse[ft]``."""

from __future__ import annotations

import importlib.util
import os

#: What to run when torchft is missing.
_INSTALL_HINT = "pip install 'commfuse[ft]'"


def require_torchft() -> None:
    """Return when torchft can be imported; else raise, naming the install command. Quiets
    torchft's Rust side (which logs every quorum at INFO) unless ``RUST_LOG`` says otherwise:
    it reads the variable once, when torchft is first imported.

    Raises:
        ImportError: torchft is not installed.
    """
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            f"fault-tolerant training runs on torchft, which is not installed: {_INSTALL_HINT}"
        )
    os.environ.setdefault("RUST_LOG", "warn")

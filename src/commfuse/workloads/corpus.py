"""A real text corpus that every machine with Python already has: the standard library's source.

A FIXED list of well-known modules under ``sysconfig.get_paths()["stdlib"]`` is read as text.
The held-out split is a separate, fixed set of files (never a slice of a training file), so no
line of held-out text was ever trained on. Bytes map to a fixed 98-symbol vocabulary: the 95
printable ASCII characters, newline and tab, and one id for everything else, so the vocabulary
does not depend on which Python version supplied the files.
"""

from __future__ import annotations

import functools
import os
import sysconfig

import torch

#: Modules trained on (present in CPython 3.10 through 3.13 as single ``.py`` files).
TRAIN_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "difflib", "dis", "enum", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "imaplib", "inspect",
    "ipaddress", "keyword", "linecache", "locale", "mailbox", "numbers", "operator", "optparse",
    "os", "pickle", "platform", "pprint", "queue", "random",
)  # fmt: skip
#: Held-out modules: evaluated on, never trained on.
HELDOUT_MODULES: tuple[str, ...] = (
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "uuid",
)  # fmt: skip
#: At least this share of each list must be present (a distribution may drop a module or two).
MIN_PRESENT_FRACTION = 0.75

#: Symbol 0 is "other byte"; 1 newline; 2 tab; 3.. printable ASCII 32..126.
VOCAB_SIZE = 3 + (127 - 32)
_TABLE = torch.zeros(256, dtype=torch.long)
_TABLE[10] = 1
_TABLE[9] = 2
_TABLE[32:127] = torch.arange(3, VOCAB_SIZE)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def module_paths(modules: tuple[str, ...]) -> list[str]:
    """Paths of the listed modules that exist; ValueError when too many are missing."""
    root = stdlib_dir()
    paths = [os.path.join(root, f"{m}.py") for m in modules]
    present = [p for p in paths if os.path.isfile(p)]
    if len(present) < MIN_PRESENT_FRACTION * len(paths):
        missing = [p for p in paths if p not in present]
        raise ValueError(
            f"the stdlib corpus needs the Python standard library's sources under {root}; "
            f"{len(missing)} of {len(paths)} files are missing (e.g. {missing[0]})"
        )
    return present


def encode(data: bytes) -> torch.Tensor:
    """Bytes -> symbol ids (int64), through the fixed table."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return _TABLE[raw]


def decode(ids: torch.Tensor) -> str:
    """Symbol ids -> text ('?' for the 'other byte' symbol); for samples and debugging."""
    chars = {0: "?", 1: "\n", 2: "\t"} | {3 + i: chr(32 + i) for i in range(95)}
    return "".join(chars[int(i)] for i in ids)


@functools.lru_cache(maxsize=2)
def load_split(split: str) -> torch.Tensor:
    """The ``"train"`` or ``"heldout"`` split as one long tensor of symbol ids (files joined)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; use 'train' or 'heldout'")
    modules = TRAIN_MODULES if split == "train" else HELDOUT_MODULES
    parts = []
    for path in module_paths(modules):
        with open(path, "rb") as fh:
            parts.append(encode(fh.read()))
    return torch.cat(parts)

"""Communicators by name, for operators whose arguments must be plain values.

A ``torch.library`` operator takes tensors, numbers and strings, not Python objects, so
``torch.ops.commfuse.*`` cannot be handed a ``Communicator``. torch's functional collectives
meet the same limit with process groups: a group is given a name when it is created
(``ProcessGroup.group_name``), the operators take that string, and the dispatcher turns it back
into the group through one registry (``c10d._resolve_process_group``). commfuse does the same
one level up: every ``Communicator`` registers itself here when it is made, under
``Communicator.key``, and the operators take the key (``Communicator.resolve(key)``).

The key is ``"<process group name>:<n>"``, ``n`` counting the communicators built over that
group in this process: ranks that build the same communicators over a group in the same order
(as they must create their process groups) give each the same key, so a traced graph holds the
same string on every rank.

The registry holds communicators weakly: it never keeps one alive. A key whose communicator has
been collected no longer resolves, and a new communicator never reuses it (the count only
grows). Only ``communicator.py`` uses this module.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from commfuse.comm.communicator import Communicator

_LOCK = threading.Lock()
_BY_KEY: weakref.WeakValueDictionary[str, Communicator] = weakref.WeakValueDictionary()
_BUILT: dict[str, int] = {}
"""Communicators built so far over each process group, by the group's name."""


def register(comm: Communicator, group_name: str) -> str:
    """File ``comm`` (over the process group named ``group_name``) under a new key; the key."""
    with _LOCK:
        count = _BUILT.get(group_name, 0)
        _BUILT[group_name] = count + 1
        key = f"{group_name}:{count}"
        _BY_KEY[key] = comm
    return key


def resolve(key: str) -> Communicator:
    """The live communicator filed under ``key``.

    Raises:
        ValueError: no live communicator has that key (never made in this process, or
            collected since: keep the communicator alive while its operators run)."""
    with _LOCK:
        comm = _BY_KEY.get(key)
    if comm is None:
        raise ValueError(
            f"no live Communicator has key {key!r}: pass comm.key of a communicator "
            "made in this process, and keep it alive while its operators run"
        )
    return comm

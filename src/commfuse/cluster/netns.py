"""Entering network namespaces from Python threads, without touching the caller's namespace.

setns(2) with _CLONE_NEWNET moves only the *calling thread* into the namespace; other threads of
the process stay where they are. A socket belongs for its whole life to the namespace it was
created in, whichever thread later uses it. So the safe way to get a socket inside an emulated
host is a short-lived helper thread that enters the namespace, creates the socket and exits,
handing the socket back. The main thread is never moved: code that runs on it afterwards
(torch, gloo, other labs) would silently end up in the wrong network.

Namespaces are the ones made by ``ip netns add``: a file under /var/run/netns names each one.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

#: setns(2) flag: the file descriptor must refer to a network namespace.
_CLONE_NEWNET = 0x40000000
#: Where ``ip netns add NAME`` bind-mounts the namespace so it outlives its processes.
_NETNS_DIR = "/var/run/netns"
#: Accept backlog of listening sockets: a rendezvous may see every rank of a large job at once.
_LISTEN_BACKLOG = 512

_libc: ctypes.CDLL | None = None


T = TypeVar("T")


def _setns(fd: int, nstype: int) -> int:
    """Call libc's setns; returns 0 or the errno. Loaded lazily so importing never fails."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        return ctypes.get_errno()
    return 0


def _netns_path(name: str) -> str:
    """The file that names namespace ``name``; refuses names that would escape _NETNS_DIR."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad network namespace name {name!r}: use a plain name like cfuse3fa2-h0")
    return os.path.join(_NETNS_DIR, name)


def enter_netns(name: str) -> None:
    """Move the calling thread (only) into network namespace ``name``.

    Call it on a helper thread that is about to exit or is dedicated to that namespace, or first
    thing in a fresh child process that should live there (a rank). Never on the main thread of a
    process that keeps using its own network. Raises OSError naming the namespace and the reason.
    """
    path = _netns_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            exc.errno, f"network namespace {name!r} does not exist (no {path}); is its lab up?"
        ) from exc
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot open network namespace {name!r} ({path}): {exc.strerror}"
        ) from exc
    try:
        err = _setns(fd, _CLONE_NEWNET)
    finally:
        os.close(fd)
    if err:
        hint = " (needs root / CAP_SYS_ADMIN)" if err == 1 else ""
        raise OSError(
            err, f"setns into network namespace {name!r} failed: {os.strerror(err)}{hint}"
        )


def call_in_netns(name: str, make: Callable[[], T]) -> T:
    """``make()`` on a short-lived thread inside namespace ``name``; its result or its error.

    Sockets (and anything that creates them, like a TCPStore) belong to the namespace of the
    thread that made them; the caller's thread never moves.
    """
    _netns_path(name)  # validate on the caller's thread, for a clear traceback
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            enter_netns(name)
            result.append(make())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"in-netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def socket_in_netns(name: str, host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket created inside namespace ``name``, bound to ``host:port``.

    Port 0 picks a free port; read it back with ``getsockname()``. The socket has SO_REUSEADDR
    (a restarted rendezvous must not wait out TIME_WAIT), a backlog of _LISTEN_BACKLOG and is not
    inherited by child processes. The calling thread's namespace does not change.
    """

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.set_inheritable(False)
            sock.bind((host, port))
            sock.listen(_LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno,
                f"cannot listen on {host}:{port} in namespace {name!r}: {exc.strerror}",
            ) from exc
        return sock

    return call_in_netns(name, make)

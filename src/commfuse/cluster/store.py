"""The rendezvous store, hosted by the launcher on a socket it binds itself.

Binding the socket here (port 0) picks a free port atomically, so two jobs can start at once
without racing for a port, and lets us choose the address it listens on: loopback for local
jobs, the emulated host's own address inside its namespace for netlab jobs. TCPStore adopts the
socket through ``master_listen_fd``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import TypeVar

from torch._C._distributed_c10d import TCPStore

T = TypeVar("T")


@dataclass
class HostedStore:
    """A TCPStore server and the socket it listens on; keep this object alive for the job.

    The server owns a duplicate of ``listener``'s descriptor and closes it when it is destroyed,
    so each descriptor is closed exactly once (handing it ``listener.fileno()`` itself would close
    that number a second time, later, when it may belong to another socket or pipe).
    """

    store: TCPStore | None
    listener: socket.socket
    addr: str
    port: int

    def close(self) -> None:
        """Stop listening: close our socket and drop the server (with its copy of the socket)."""
        self.listener.close()
        self.store = None


def _listen_socket(addr: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on addr:port in the current network namespace."""
    try:
        sock = socket.create_server((addr, port), backlog=512, reuse_port=False)
    except OSError as err:
        where = f"{addr}:{port}" if port else addr
        raise ValueError(
            f"cannot listen on {where} ({err.strerror}); choose another port (MASTER_PORT)"
        ) from err
    return sock


def host_store(
    addr: str = "127.0.0.1", *, port: int = 0, netns: str | None = None, timeout_s: float = 300.0
) -> HostedStore:
    """Start a TCPStore server on addr (inside network namespace ``netns`` when given)."""
    if netns is None:
        sock = _listen_socket(addr, port)
    else:
        from commfuse.cluster.netns import call_in_netns, socket_in_netns

        sock = socket_in_netns(netns, addr, port)
    bound_port = int(sock.getsockname()[1])

    def make_store() -> TCPStore:
        return TCPStore(
            addr,
            bound_port,
            None,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=os.dup(sock.fileno()),  # the store closes the fd it is given
        )

    try:
        # The server side adopts our socket, but the constructor also connects to addr:port as a
        # client; inside an emulated host that address is reachable only from its namespace.
        store = make_store() if netns is None else call_in_netns(netns, make_store)
    except BaseException:
        sock.close()
        raise
    return HostedStore(store=store, listener=sock, addr=addr, port=bound_port)

"""The rendezvous store, hosted by the launcher on a socket it binds itself.

Binding the socket here (port 0) picks a free port atomically, so two jobs can start at once
without racing for a port, and lets us choose the address it listens on: loopback for local
jobs, the emulated host's own address inside its namespace for netlab jobs. TCPStore adopts the
socket through ``master_listen_fd``.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class HostedStore:
    """A TCPStore server and the socket it listens on; keep this object alive for the job."""

    store: dist.TCPStore
    listener: socket.socket
    addr: str
    port: int

    def close(self) -> None:
        self.listener.close()


def listen_socket(addr: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on addr:port in the current network namespace."""
    try:
        sock = socket.create_server((addr, port), backlog=512, reuse_port=False)
    except OSError as err:
        where = f"{addr}:{port}" if port else addr
        raise ValueError(
            f"cannot listen on {where} ({err.strerror}); choose another --master-port"
        ) from err
    return sock


def host_store(
    addr: str = "127.0.0.1", *, port: int = 0, netns: str | None = None, timeout_s: float = 300.0
) -> HostedStore:
    """Start a TCPStore server on addr (inside network namespace ``netns`` when given)."""
    if netns is None:
        sock = listen_socket(addr, port)
    else:
        from commfuse.cluster.netns import socket_in_netns

        sock = socket_in_netns(netns, addr, port)
    bound_port = int(sock.getsockname()[1])
    store = dist.TCPStore(
        addr,
        bound_port,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    return HostedStore(store=store, listener=sock, addr=addr, port=bound_port)

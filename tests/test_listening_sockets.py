"""Nothing a commfuse job listens on is reachable from outside the machine.

A job's listening sockets are the launcher's rendezvous store and each rank's gloo listener.
On a local job they must be bound to loopback; on an emulated cluster (netlab) to loopback or
to an address that exists only inside the emulated host's network namespace. A socket bound to
0.0.0.0 or ``::`` (every interface), or to one of the machine's real addresses, would let any
host on the network talk to the job's store and its ranks.

The test starts a real ``commfuse launch`` job whose ranks hold their sockets open
(``scripts/hold_sockets.py``), finds every process of the job (the launcher and its
descendants), maps each one's socket descriptors (``/proc/PID/fd``) to the TCP tables of the
namespaces the job's processes are in (``/proc/PID/net/tcp`` and ``tcp6``), and checks each
socket in LISTEN state.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).parent / "scripts" / "hold_sockets.py")
COMMFUSE = [sys.executable, "-m", "commfuse.cli"]
TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: the network namespace it lives in and its local address."""

    netns: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    pids: tuple[int, ...]

    def __str__(self) -> str:
        where = "root namespace" if self.netns == own_netns() else f"namespace {self.netns}"
        return f"{self.address}:{self.port} in the {where} (pids {list(self.pids)})"


def own_netns() -> str:
    return os.readlink("/proc/self/ns/net")


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def decode(hex_addr: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``/proc/net/tcp``'s ``0100007F:1F90`` (host-order 32-bit words) as (address, port)."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.IPv4Address(words) if len(raw) == 4 else ipaddress.IPv6Address(words)
    return ip, int(port, 16)


def listeners(pids: list[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state held open by one of ``pids``."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}  # netns -> inode -> (local, state)
    owners: dict[str, set[int]] = {}
    for pid in [os.getpid(), *pids]:  # our own: the root namespace's table, not our sockets
        with contextlib.suppress(OSError):
            netns = os.readlink(f"/proc/{pid}/ns/net")
            if netns not in tables:
                table: dict[str, tuple[str, str]] = {}
                for name in ("tcp", "tcp6"):
                    for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                        fields = line.split()
                        table[fields[9]] = (fields[1], fields[3])
                tables[netns] = table
        if pid not in pids:
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if match := re.fullmatch(r"socket:\[(\d+)\]", target):
                        owners.setdefault(match.group(1), set()).add(pid)
    found = []
    for netns, table in tables.items():
        for inode, (local, state) in table.items():
            if state == TCP_LISTEN and inode in owners:
                address, port = decode(local)
                found.append(Listener(netns, address, port, tuple(sorted(owners[inode]))))
    return found


def exposed(listener: Listener) -> bool:
    """Whether anything outside the machine could reach ``listener``."""
    if listener.address.is_unspecified:
        return True  # every interface, the real ones included (or, in a namespace, its veth)
    if listener.address.is_loopback:
        return False
    return listener.netns == own_netns()  # a real interface's address


@contextlib.contextmanager
def holding_job(tmp_path: Path, *layout: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A ``commfuse launch`` job whose ranks hold their sockets until the block ends."""
    release = tmp_path / "release"
    proc = subprocess.Popen(
        [*COMMFUSE, "launch", *layout, "--timeout", "150", SCRIPT, str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = 0
        expected = int(layout[layout.index("--nproc") + 1]) if "--nproc" in layout else 2
        lines = []
        deadline = time.monotonic() + 120
        while ready < expected and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            ready += "HOLDING pid=" in line
        assert ready == expected, (
            f"the job did not come up:\n{''.join(lines)}{proc.stderr.read() if proc.stderr else ''}"
        )
        yield proc, expected
    finally:
        release.touch()
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_job(tmp_path: Path, *layout: str) -> list[Listener]:
    with holding_job(tmp_path, *layout) as (proc, ranks):
        found = listeners(descendants(proc.pid))
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # The launcher's store, and each rank's gloo listener: the check saw the job's sockets.
    assert len(found) >= 1 + ranks, [str(x) for x in found]
    assert [str(x) for x in found if exposed(x)] == []
    return found


@pytest.mark.e2e
def test_a_local_job_listens_on_loopback_only(tmp_path: Path) -> None:
    found = check_job(tmp_path, "--nproc", "2")
    assert all(x.address.is_loopback and x.netns == own_netns() for x in found), found


@pytest.mark.netlab
def test_an_emulated_job_listens_inside_its_namespaces_only(tmp_path: Path) -> None:
    found = check_job(tmp_path, "--hosts", "2", "--ranks-per-host", "1", "--link", "1gbit")
    assert all(x.netns != own_netns() for x in found), [str(x) for x in found]


def hold_until(ready_dir: str, release: str) -> None:
    """A rank of ``commfuse.cluster.run``: all-reduce once, say so, hold the sockets."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    Path(ready_dir, str(dist.get_rank())).touch()
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.e2e
def test_a_job_of_cluster_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """``commfuse.cluster.run`` (what the bench, train and compare commands start) hosts the
    store in this process and spawns the ranks as its children."""
    from commfuse.cluster import run

    ready, release = tmp_path / "ready", tmp_path / "release"
    ready.mkdir()
    done: list[BaseException | None] = []

    def job() -> None:
        try:
            run(hold_until, str(ready), str(release), world_size=2, timeout_s=150)
            done.append(None)
        except BaseException as err:
            done.append(err)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(ready)) < 2 and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
        assert len(os.listdir(ready)) == 2, done
        found = listeners(descendants(os.getpid()))
    finally:
        release.touch()
        thread.join(timeout=60)
    assert done == [None]
    assert len(found) >= 3, [str(x) for x in found]
    assert [str(x) for x in found if exposed(x)] == []


def test_the_check_sees_a_socket_on_every_interface(tmp_path: Path) -> None:
    """The check itself: a process listening on 0.0.0.0 is reported, with its pid."""
    code = "import socket, time; s = socket.create_server(('0.0.0.0', 0)); print('up', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        found = [x for x in listeners([proc.pid]) if exposed(x)]
        assert [x.pids for x in found] == [(proc.pid,)], found
    finally:
        proc.kill()
        proc.wait()

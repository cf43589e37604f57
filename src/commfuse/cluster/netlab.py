"""An emulated cluster on one machine: one network namespace per host, per-host shaped links.

Each host k is a namespace ``<lab>-h<k>`` holding one end of a veth pair (``<lab>h<k>a``, address
10.77.0.<100+k>/24); the other end (``<lab>h<k>b``) is a port of the lab's bridge ``<lab>br`` in the
root namespace. Ranks of one host talk over its loopback; ranks of different hosts cross the
bridge. A ``tbf`` qdisc on both ends of each veth caps the host's link in each direction: the
namespace end shapes what the host sends, the bridge end what it receives. The root namespace has
no address on any of this, so every lab can reuse the same subnet on its own L2 segment.

Namespaces, bridges and veths outlive the process that made them, so every name starts with
the lab id (``cfuse`` + 4 hex digits), each lab leaves a state file in STATE_DIR, teardown works
by name (it also cleans a half-built lab), an atexit hook tears down labs of this process, and
``down_all`` removes leftovers of crashed ones.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import Any

from commfuse.cluster.netns import enter_netns, socket_in_netns
from commfuse.cluster.topology import Topology

LAB_PREFIX = "cfuse"
LAB_ID_LEN = len(LAB_PREFIX) + 4
STATE_DIR = "/run/commfuse/netlab"
_SUBNET = "10.77.0"
#: Host k's address ends in FIRST_HOST_OCTET + k: a three-digit last octet for every host (up to
#: topology.MAX_HOSTS), so the addresses sort as text in host order. torchrun's c10d rendezvous
#: ranks its agents by sorting their ``--local-addr`` as strings; with 10.77.0.<k+1>, 10.77.0.10
#: sorted before 10.77.0.2 and from 10 hosts on scrambled which host ran which ranks.
FIRST_HOST_OCTET = 100
#: tbf queue bound, as time at the link rate. TCP Small Queues keep a single flow's backlog far
#: below this, so it only matters when many flows (all ranks of a host) share one link; 50 ms
#: holds them without drops while still bounding the queueing delay.
_TBF_LATENCY_MS = 50
_ETH_HEADER = 14
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


class NetlabError(RuntimeError):
    """Building or removing the emulated network failed; the message names the command."""


def run_cmd(cmd: str | list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command (a string is split on spaces; our names have none).

    On failure raise NetlabError with the command and its stderr.
    """
    argv = cmd.split() if isinstance(cmd, str) else cmd
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetlabError(f"`{shlex.join(argv)}` could not run: {exc}") from exc
    if check and proc.returncode != 0:
        err = proc.stderr.strip() or proc.stdout.strip() or "no message"
        raise NetlabError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): {err}")
    return proc


def _netns_names() -> list[str]:
    if shutil.which("ip") is None:
        return []
    out = run_cmd("ip -j netns list").stdout.strip()
    return [str(e["name"]) for e in json.loads(out)] if out else []


def _link_names() -> list[str]:
    if shutil.which("ip") is None:
        return []
    return [str(e["ifname"]) for e in json.loads(run_cmd("ip -j link show").stdout)]


def _new_lab_id() -> str:
    taken = {n[:LAB_ID_LEN] for n in _netns_names() + _link_names()}
    while True:
        lab_id = LAB_PREFIX + secrets.token_hex(2)
        if lab_id not in taken and not os.path.exists(_state_path(lab_id)):
            return lab_id


def _state_path(lab_id: str) -> str:
    return os.path.join(STATE_DIR, f"{lab_id}.json")


def _has_caps(*caps: int) -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return os.geteuid() == 0
    return all(eff >> cap & 1 for cap in caps)


def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/PID/stat), to tell a live creator from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def netlab_unavailable_reason() -> str | None:
    """None when this process can build namespaces, else one line saying why not (cached)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not _has_caps(_CAP_NET_ADMIN, _CAP_SYS_ADMIN):
        return (
            "building an emulated network needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run as root"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; install iproute2"
    probe = f"{_new_lab_id()}-probe"
    try:
        run_cmd(f"ip netns add {probe}")
        run_cmd(f"tc -n {probe} qdisc add dev lo root tbf rate 1gbit burst 256kb latency 50ms")
    except NetlabError as exc:
        return f"cannot build network namespaces here: {exc}"
    finally:
        run_cmd(f"ip netns del {probe}", check=False)
    return None


def _remove_prefix(prefix: str) -> list[str]:
    """Remove every link, namespace and state file whose name starts with ``prefix``.

    Root-side links go first: deleting one veth end deletes its peer even when the namespace
    holding the peer stays alive because a process still runs in it. Bridges go last.
    """
    removed: list[str] = []
    failed: list[str] = []
    links = sorted(
        (n for n in _link_names() if n.startswith(prefix)), key=lambda n: n.endswith("br")
    )
    for name in links:
        if run_cmd(f"ip link del {name}", check=False).returncode == 0:
            removed.append(f"link {name}")
    for name in (n for n in _netns_names() if n.startswith(prefix)):
        proc = run_cmd(f"ip netns del {name}", check=False)
        (removed if proc.returncode == 0 else failed).append(f"netns {name}")
    if os.path.isdir(STATE_DIR):
        for fname in sorted(os.listdir(STATE_DIR)):
            if fname.startswith(prefix) and fname.endswith(".json"):
                try:
                    os.unlink(os.path.join(STATE_DIR, fname))
                    removed.append(f"state {fname}")
                except FileNotFoundError:
                    pass
    failed += [f"link {n}" for n in _link_names() if n.startswith(prefix)]
    if failed:
        raise NetlabError(f"could not remove {', '.join(failed)}; try `commfuse net down --all`")
    return removed


_LIVE: set[Netlab] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _down_live() -> None:
    """Tear down the labs this process still holds when the interpreter exits."""
    with _LIVE_LOCK:
        labs = list(_LIVE)
    for lab in labs:
        try:
            lab.down()
        except Exception as exc:  # an exit hook must not raise; say what is left behind
            print(f"commfuse: could not tear down lab {lab.lab_id}: {exc}", file=sys.stderr)


class Netlab:
    """An emulated cluster of ``topology.num_hosts`` namespaces joined by shaped links.

    ``burst_kb`` is the tbf bucket in KiB. It must exceed one frame (MTU plus the Ethernet
    header): tbf drops every packet larger than its burst, which would silently blackhole full
    size frames. 256 KiB at MTU 9000 keeps the rate exact over milliseconds and gloo runs cleanly.
    """

    def __init__(
        self, topology: Topology, *, mtu: int = 9000, burst_kb: int = 256, lab_id: str | None = None
    ) -> None:
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu} is outside 576..65535; use e.g. 9000")
        if burst_kb * 1024 <= mtu + _ETH_HEADER:
            raise ValueError(
                f"burst {burst_kb}kb must exceed one frame ({mtu + _ETH_HEADER} bytes at mtu {mtu}): "
                "tbf drops every packet larger than its burst; raise burst_kb"
            )
        if lab_id is not None and not (
            len(lab_id) == LAB_ID_LEN
            and lab_id.startswith(LAB_PREFIX)
            and all(c in "0123456789abcdef" for c in lab_id[len(LAB_PREFIX) :])
        ):
            raise ValueError(
                f"bad lab id {lab_id!r}: use {LAB_PREFIX} and 4 hex digits, like cfuse3fa2"
            )
        self._topology = topology
        self._mtu, self._burst_kb = mtu, burst_kb
        self._lab_id = lab_id or _new_lab_id()
        self._lock = threading.RLock()
        self._touched = False  # anything may exist once up() has started
        self._is_up = False
        self._created = time.time()

    @property
    def lab_id(self) -> str:
        """Prefix of every name this lab creates."""
        return self._lab_id

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def bridge(self) -> str:
        return f"{self._lab_id}br"

    def _check_host(self, host: int) -> int:
        if not 0 <= host < self._topology.num_hosts:
            raise IndexError(f"host {host} is not in 0..{self._topology.num_hosts - 1}")
        return host

    def namespace(self, host: int) -> str:
        return f"{self._lab_id}-h{self._check_host(host)}"

    def address(self, host: int) -> str:
        return f"{_SUBNET}.{FIRST_HOST_OCTET + self._check_host(host)}"

    def ifname(self, host: int) -> str:
        """The host's interface inside its namespace (for GLOO_SOCKET_IFNAME)."""
        return f"{self._lab_id}h{self._check_host(host)}a"

    def peer(self, host: int) -> str:
        """The root-side (bridge port) end of host's veth."""
        return f"{self._lab_id}h{self._check_host(host)}b"

    def set_link(self, host: int, *, up: bool) -> None:
        """Take host's link down (every frame to and from it is lost, its sockets stay open,
        as when a cable is pulled) or bring it back up."""
        run_cmd(f"ip link set {self.peer(host)} {'up' if up else 'down'}")

    def set_rate(self, host: int, link_mbit: float) -> None:
        """Shape host's link to ``link_mbit`` in each direction from now on (its own rate; the
        other hosts keep theirs)."""
        if not link_mbit > 0:
            raise ValueError(f"link_mbit must be more than 0, got {link_mbit}")
        self._tbf(f"-n {self.namespace(host)}", self.ifname(host), link_mbit, verb="replace")
        self._tbf("", self.peer(host), link_mbit, verb="replace")

    def _tbf(
        self, netns: str, dev: str, link_mbit: float | None = None, *, verb: str = "add"
    ) -> None:
        rate = self._topology.link_mbit if link_mbit is None else link_mbit
        assert rate is not None
        kbit = max(1, round(rate * 1000))
        burst, lat = f"{self._burst_kb}kb", f"{_TBF_LATENCY_MS}ms"
        run_cmd(
            f"tc {netns} qdisc {verb} dev {dev} root tbf rate {kbit}kbit burst {burst} latency {lat}"
        )

    def _write_state(self, **extra: Any) -> None:
        """Record the lab in STATE_DIR (atomically) so ``net status`` can list and age it."""
        os.makedirs(STATE_DIR, exist_ok=True)
        topo, pid = self._topology, os.getpid()
        state: dict[str, Any] = dict(
            lab_id=self._lab_id, num_hosts=topo.num_hosts, ranks_per_host=topo.ranks_per_host,
            link_mbit=topo.link_mbit, mtu=self._mtu, burst_kb=self._burst_kb, pid=pid,
            pid_start=_proc_start(pid), created=self._created, kept=False,
        )  # fmt: skip
        state.update(extra)
        tmp = _state_path(self._lab_id) + ".tmp"
        with open(tmp, "w", encoding="ascii") as f:
            json.dump(state, f)
        os.replace(tmp, _state_path(self._lab_id))

    def _claim(self) -> None:
        """Create the state file exclusively, so two processes never build (or tear down) one id."""
        os.makedirs(STATE_DIR, exist_ok=True)
        taken = any(n.startswith(self._lab_id) for n in _netns_names() + _link_names())
        try:
            if taken:
                raise FileExistsError
            os.close(os.open(_state_path(self._lab_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            raise NetlabError(f"lab {self._lab_id} already exists; pick another lab_id") from None

    def up(self) -> None:
        """Build the lab; if anything fails midway, remove what was made and re-raise."""
        with self._lock:
            if self._is_up:
                return
            reason = netlab_unavailable_reason()
            if reason is not None:
                raise NetlabError(reason)
            self._claim()
            self._touched = True
            with _LIVE_LOCK:
                _LIVE.add(self)
            try:
                self._build()
            except BaseException:
                try:
                    self.down()
                except Exception as exc:  # keep the original error; report the leftover
                    print(f"commfuse: cleanup of {self._lab_id} failed: {exc}", file=sys.stderr)
                raise
            self._is_up = True

    def _build(self) -> None:
        self._write_state()  # first, so a crash during the build is attributed to this lab
        br, mtu = self.bridge, self._mtu
        run_cmd(f"ip link add {br} mtu {mtu} type bridge")
        _no_ipv6(br)
        run_cmd(f"ip link set {br} up")
        for k in range(self._topology.num_hosts):
            ns, inner, outer = self.namespace(k), self.ifname(k), self.peer(k)
            run_cmd(f"ip netns add {ns}")
            run_cmd(f"ip link add {inner} mtu {mtu} type veth peer name {outer} mtu {mtu}")
            _no_ipv6(outer)
            run_cmd(f"ip link set {inner} netns {ns}")
            run_cmd(f"ip link set {outer} master {br} up")
            run_cmd(f"ip -n {ns} link set lo up")
            run_cmd(f"ip -n {ns} addr add {self.address(k)}/24 dev {inner}")
            run_cmd(f"ip -n {ns} link set {inner} up")
            if self._topology.link_mbit is not None:
                self._tbf(f"-n {ns}", inner)  # what host k sends
                self._tbf("", outer)  # what host k receives

    def keep(self) -> None:
        """Let the lab outlive this process (``net up``): no atexit teardown, not an orphan."""
        with self._lock:
            if self._is_up:
                self._write_state(kept=True)
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def down(self) -> None:
        """Remove everything of this lab, even if half-built. Safe twice and from any thread."""
        with self._lock:
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if self._touched:
                _remove_prefix(self._lab_id)
            self._is_up = False

    def __enter__(self) -> Netlab:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()


def _no_ipv6(ifname: str) -> None:
    """Keep root-side ports address-free (no link-local, no router solicitations on the links)."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w", encoding="ascii") as f:
            f.write("1")
    except OSError:
        pass  # IPv6 disabled or absent: nothing to keep quiet


def list_labs() -> list[dict[str, Any]]:
    """Every lab visible on this machine, from state files and from leftover names.

    ``status`` is "active" (its creator runs), "kept" (made by ``net up`` to outlive it) or
    "orphan" (its creator died without tearing it down, or there is no state file at all).
    """
    labs: dict[str, dict[str, Any]] = {}
    if os.path.isdir(STATE_DIR):
        for fname in sorted(os.listdir(STATE_DIR)):
            if fname.startswith(LAB_PREFIX) and fname.endswith(".json"):
                try:
                    with open(os.path.join(STATE_DIR, fname), encoding="ascii") as f:
                        state = dict(json.load(f))
                except (OSError, ValueError):
                    state = {}
                labs[fname[: -len(".json")]] = {
                    **state,
                    "state_file": os.path.join(STATE_DIR, fname),
                }
    for kind, names in (("namespaces", _netns_names()), ("links", _link_names())):
        for name in names:
            if name.startswith(LAB_PREFIX):
                lab = labs.setdefault(name[:LAB_ID_LEN], {"state_file": None})
                lab.setdefault(kind, []).append(name)
    result = []
    for lab_id, lab in sorted(labs.items()):
        pid, start = lab.get("pid"), lab.get("pid_start")
        alive = isinstance(pid, int) and start is not None and _proc_start(pid) == start
        status = "kept" if lab.get("kept") else "active" if alive else "orphan"
        result.append({"namespaces": [], "links": [], **lab, "lab_id": lab_id, "status": status})
    return result


def down_all(prefix: str = LAB_PREFIX) -> list[str]:
    """Remove every namespace, link and state file whose name starts with ``prefix``.

    The default removes all labs on the machine, including ones other processes still use; pass
    a lab id to remove one lab by name only.
    """
    if not prefix.startswith(LAB_PREFIX):
        raise ValueError(f"refusing to remove names not starting with {LAB_PREFIX!r}: {prefix!r}")
    return _remove_prefix(prefix)


def measure_link(
    lab: Netlab, src_host: int = 0, dst_host: int = 1, *, num_bytes: int = 16 << 20
) -> float:
    """Achieved Mbit/s of one bulk TCP transfer from ``src_host`` to ``dst_host``.

    The receiver's socket is made inside dst's namespace; the sender runs on a helper thread
    that enters src's namespace (the calling thread never moves). The rate counts the bytes after
    the first read over the time from the first to the last read, so connection setup is left out.
    """
    spec = lab.topology.link_mbit
    timeout = max(10.0, 5 * num_bytes * 8 / ((spec or 1000.0) * 1e6))
    listener = socket_in_netns(lab.namespace(dst_host), lab.address(dst_host), 0)
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def send() -> None:
        try:
            enter_netns(lab.namespace(src_host))
            with socket.create_connection((lab.address(dst_host), port), timeout=timeout) as sock:
                chunk = memoryview(bytes(1 << 20))
                left = num_bytes
                while left > 0:
                    sock.sendall(chunk[: min(left, len(chunk))])
                    left -= len(chunk)
        except BaseException as exc:
            errors.append(exc)

    sender = threading.Thread(target=send, name="netlab-measure-send", daemon=True)
    with listener:
        listener.settimeout(timeout)
        sender.start()
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            sender.join(timeout)
            raise NetlabError(
                f"no connection {src_host}->{dst_host}: {errors[0] if errors else exc}"
            ) from exc
    buf = bytearray(1 << 20)
    got, first_bytes, t_first, t_last = 0, 0, 0.0, 0.0
    with conn:
        conn.settimeout(timeout)
        while got < num_bytes:
            n = conn.recv_into(buf)
            if n == 0:
                break
            t_last = time.perf_counter()
            if got == 0:
                t_first, first_bytes = t_last, n
            got += n
    sender.join(timeout)
    if errors or got < num_bytes:
        raise NetlabError(
            f"transfer {src_host}->{dst_host} got {got} of {num_bytes} bytes: {errors}"
        )
    if t_last <= t_first:
        raise NetlabError(
            f"transfer {src_host}->{dst_host} arrived in one read; use more num_bytes"
        )
    return (got - first_bytes) * 8 / (t_last - t_first) / 1e6


def tbf_drops(lab: Netlab) -> int:
    """Packets dropped by this lab's tbf qdiscs so far (0 on a healthy lab)."""
    total = 0
    for k in range(lab.topology.num_hosts):
        for netns, dev in ((f"-n {lab.namespace(k)}", lab.ifname(k)), ("", lab.peer(k))):
            out = run_cmd(f"tc -s -j {netns} qdisc show dev {dev}").stdout
            total += sum(
                int(q.get("drops", 0)) for q in json.loads(out or "[]") if q.get("kind") == "tbf"
            )
    return total


def self_check(lab: Netlab, *, num_bytes: int | None = None) -> dict[str, Any]:
    """Measure hosts 0->1 and 1->0 against the link spec.

    Returns spec_mbit, measured_mbit and ratio (of the slower direction; ratio is None when links
    are unshaped), the per-direction ``pairs`` and the tbf ``drops``. The default transfer lasts
    about 0.25 s at the spec rate (4 to 64 MiB).
    """
    if lab.topology.num_hosts < 2:
        raise ValueError("the self-check needs at least 2 hosts")
    spec = lab.topology.link_mbit
    if num_bytes is None:
        num_bytes = (
            64 << 20 if spec is None else int(min(max(spec * 1e6 / 8 / 4, 4 << 20), 64 << 20))
        )
    pairs: list[dict[str, Any]] = []
    for src, dst in ((0, 1), (1, 0)):
        mbit = measure_link(lab, src, dst, num_bytes=num_bytes)
        pairs.append(
            dict(src=src, dst=dst, measured_mbit=mbit, ratio=mbit / spec if spec else None)
        )
    slowest = min(pairs, key=lambda p: float(p["measured_mbit"]))
    drops = tbf_drops(lab) if spec else 0
    return dict(spec_mbit=spec, measured_mbit=slowest["measured_mbit"], ratio=slowest["ratio"],
                pairs=pairs, num_bytes=num_bytes, drops=drops)  # fmt: skip

"""The emulated cluster: names, addresses, reachability, shaping accuracy and cleanup.

Needs root (network namespaces): marked ``netlab``, skipped with the reason otherwise and failed
under ``CI=true`` (``conftest.py``). Other programs may run labs
on the same machine at the same time, so every check and every cleanup here is by lab id: a test
never removes a lab it did not make.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from commfuse.cli import main
from commfuse.cluster.netlab import (
    STATE_DIR,
    Netlab,
    NetlabError,
    down_all,
    list_labs,
    measure_link,
    tbf_drops,
)
from commfuse.cluster.netns import enter_netns, socket_in_netns
from commfuse.cluster.topology import Topology


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _leftovers(lab_id: str) -> list[str]:
    """Everything on the machine that still carries ``lab_id``: namespaces, links, state file."""
    names = [line.split()[0] for line in _out("ip", "netns", "list").splitlines() if line]
    names += [line.split(": ")[1].split("@")[0] for line in _out("ip", "-o", "link").splitlines()]
    left = [n for n in names if n.startswith(lab_id)]
    if os.path.exists(os.path.join(STATE_DIR, f"{lab_id}.json")):
        left.append("state file")
    return left


def _my_netns() -> str:
    return os.readlink("/proc/thread-self/ns/net")


def test_host_addresses_sort_as_text_in_host_order() -> None:
    # torchrun's c10d rendezvous ranks its agents by sorting their node descriptors, whose first
    # field is the --local-addr string: with addresses in host order as text, host k keeps node
    # rank k at any size (with 10.77.0.<k+1>, host 9's 10.77.0.10 sorted before 10.77.0.2).
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    from commfuse.cluster.topology import MAX_HOSTS

    lab = Netlab(Topology(num_hosts=MAX_HOSTS))  # built lazily: nothing is created here
    addresses = [lab.address(k) for k in range(MAX_HOSTS)]
    assert len(set(addresses)) == MAX_HOSTS
    assert all(0 < int(a.rsplit(".", 1)[1]) < 255 for a in addresses)
    nodes = [_NodeDesc(addr, 1000 + k, 0) for k, addr in enumerate(addresses)]
    assert [addresses.index(node.addr) for node in sorted(nodes)] == list(range(MAX_HOSTS))


@pytest.mark.netlab
def test_up_builds_expected_names_addresses_and_shaping() -> None:
    with Netlab(Topology(num_hosts=3, link_mbit=200)) as lab:
        lid = lab.lab_id
        assert lid.startswith("cfuse") and len(lid) == 9
        assert {f"{lid}-h{k}" for k in range(3)} <= set(_out("ip", "netns", "list").split())
        bridge = json.loads(_out("ip", "-j", "link", "show", f"{lid}br"))[0]
        assert bridge["mtu"] == 9000 and "UP" in bridge["flags"]
        assert not json.loads(_out("ip", "-j", "addr", "show", f"{lid}br"))[0]["addr_info"]
        assert _out("ip", "-o", "route", "show", "10.77.0.0/24").strip() == ""
        for k in range(3):
            ns, inner, outer = lab.namespace(k), lab.ifname(k), f"{lid}h{k}b"
            assert len(inner) <= 15 and len(outer) <= 15
            port = json.loads(_out("ip", "-j", "link", "show", outer))[0]
            assert port["master"] == f"{lid}br" and port["mtu"] == 9000
            dev = json.loads(_out("ip", "-n", ns, "-j", "addr", "show", inner))[0]
            assert dev["mtu"] == 9000 and "UP" in dev["flags"]
            v4 = [a for a in dev["addr_info"] if a["family"] == "inet"]
            assert [(a["local"], a["prefixlen"]) for a in v4] == [(f"10.77.0.{100 + k}", 24)]
            assert lab.address(k) == f"10.77.0.{100 + k}"
            assert "UP" in json.loads(_out("ip", "-n", ns, "-j", "link", "show", "lo"))[0]["flags"]
            for argv in (["tc", "-n", ns], ["tc"]):
                qdisc = _out(*argv, "qdisc", "show", "dev", inner if len(argv) > 1 else outer)
                assert "tbf" in qdisc and "rate 200Mbit" in qdisc, qdisc
        [mine] = [lab for lab in list_labs() if lab["lab_id"] == lid]
        assert mine["status"] == "active" and mine["pid"] == os.getpid()
        assert mine["num_hosts"] == 3 and mine["link_mbit"] == 200
    assert _leftovers(lid) == []


@pytest.mark.netlab
def test_hosts_reach_each_other_and_caller_stays_put() -> None:
    before = _my_netns()
    with Netlab(Topology(num_hosts=2)) as lab:
        listener = socket_in_netns(lab.namespace(1), lab.address(1))
        assert _my_netns() == before
        port = listener.getsockname()[1]
        seen: list[str] = []

        def client() -> None:
            enter_netns(lab.namespace(0))
            seen.append(_my_netns())
            with socket.create_connection((lab.address(1), port), timeout=5) as s:
                s.sendall(b"hello")

        thread = threading.Thread(target=client)
        thread.start()
        listener.settimeout(5)
        conn, peer = listener.accept()
        with conn, listener:
            assert conn.recv(5) == b"hello"
        thread.join()
        assert peer[0] == lab.address(0)
        assert seen and seen[0] != before
        assert _my_netns() == before


@pytest.mark.netlab
@pytest.mark.parametrize(("mbit", "num_bytes"), [(200, 4 << 20), (1000, 8 << 20)])
def test_shaping_matches_spec_both_ways(mbit: int, num_bytes: int) -> None:
    # The shaper caps the rate; a busy machine can only lower what one transfer reaches (at
    # 1 Gbit/s the sender and receiver need a good part of a core), never raise it. So every
    # transfer must stay under the cap, and the fastest of up to eight must reach it: short
    # ones (under 0.2 s each), a little apart, so that one of them finds the cores free
    # between the bursts of whatever else runs beside it.
    with Netlab(Topology(num_hosts=2, link_mbit=mbit)) as lab:
        for src, dst in ((0, 1), (1, 0)):
            rates: list[float] = []
            while len(rates) < 8 and (not rates or max(rates) < 0.85 * mbit):
                if rates:
                    time.sleep(0.1)
                rates.append(measure_link(lab, src, dst, num_bytes=num_bytes))
                assert rates[-1] <= 1.15 * mbit, f"{src}->{dst}: {rates[-1]:.0f} of {mbit} Mbit/s"
            assert max(rates) >= 0.85 * mbit, (
                f"{src}->{dst}: {', '.join(f'{r:.0f}' for r in rates)} of {mbit} Mbit/s"
            )
        assert tbf_drops(lab) == 0


@pytest.mark.netlab
def test_down_removes_everything_and_is_idempotent() -> None:
    lab = Netlab(Topology(num_hosts=2, link_mbit=1000))
    lab.up()
    assert len(_leftovers(lab.lab_id)) == 2 + 3 + 1  # namespaces, bridge and ports, state file
    other = threading.Thread(target=lab.down)  # down from another thread, then again here
    other.start()
    other.join()
    lab.down()
    assert _leftovers(lab.lab_id) == []


@pytest.mark.netlab
def test_exception_inside_with_cleans_up() -> None:
    with pytest.raises(RuntimeError, match="boom"), Netlab(Topology(num_hosts=2)) as lab:
        lab_id = lab.lab_id
        raise RuntimeError("boom")
    assert _leftovers(lab_id) == []


@pytest.mark.netlab
def test_failed_up_cleans_half_built_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_tbf(self: Netlab, netns: str, dev: str) -> None:
        if dev.endswith("h1b"):
            raise NetlabError("simulated tc failure")

    monkeypatch.setattr(Netlab, "_tbf", broken_tbf)
    lab = Netlab(Topology(num_hosts=3, link_mbit=100))
    with pytest.raises(NetlabError, match="simulated"), lab:
        pass
    assert _leftovers(lab.lab_id) == []


_SCRIPT = """
import sys, time
from commfuse.cluster.netlab import Netlab
from commfuse.cluster.topology import Topology
lab = Netlab(Topology(num_hosts=2, link_mbit=100))
lab.up()
print(lab.lab_id, flush=True)
if sys.argv[1] == "raise":
    raise SystemExit("failing after up()")
time.sleep(60)
"""


def _start_lab_process(mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


@pytest.mark.netlab
def test_down_all_removes_orphan_of_killed_process() -> None:
    proc, lab_id = _start_lab_process("sleep")
    try:
        assert lab_id.startswith("cfuse"), proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert _leftovers(lab_id), "SIGKILL should leave the lab behind"
        [orphan] = [lab for lab in list_labs() if lab["lab_id"] == lab_id]
        assert orphan["status"] == "orphan" and len(orphan["namespaces"]) == 2
        # By lab id: the default prefix would also remove labs of other programs on this machine.
        removed = down_all(lab_id)
        assert f"netns {lab_id}-h0" in removed and f"link {lab_id}br" in removed
        assert _leftovers(lab_id) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        if lab_id.startswith("cfuse"):
            down_all(lab_id)


@pytest.mark.netlab
def test_atexit_tears_down_after_an_uncaught_error() -> None:
    proc, lab_id = _start_lab_process("raise")
    proc.communicate(timeout=30)
    assert proc.returncode == 1 and lab_id.startswith("cfuse")
    assert _leftovers(lab_id) == []


def _cli(*argv: str) -> int:
    return main(list(argv))


def test_bad_input_is_refused_before_anything_is_built(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="more than 0"):
        Topology(num_hosts=2, link_mbit=0)
    with pytest.raises(ValueError, match="bit/s"):
        Topology.from_spec(hosts=2, link="0mbit")
    with pytest.raises(ValueError, match="larger than its burst"):
        Netlab(Topology(num_hosts=2), burst_kb=8)
    with pytest.raises(ValueError, match="bad lab id"):
        Netlab(Topology(num_hosts=2), lab_id="mylab")
    labs_before = {lab["lab_id"] for lab in list_labs()}
    for argv in (
        ["--hosts", "0"],
        ["--hosts", "2", "--link", "0mbit"],
        ["--hosts", "2", "--link", "1tbit"],
    ):
        assert _cli("net", "up", *argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("commfuse net up: "), err
    assert {lab["lab_id"] for lab in list_labs()} == labs_before


@pytest.mark.netlab
def test_cli_up_status_down(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("net", "up", "--hosts", "2", "--link", "1gbit", "--no-check") == 0
    lab_id = capsys.readouterr().out.split()[1].rstrip(":")
    try:
        assert _cli("net", "status") == 0
        assert any(
            line.split()[:2] == [lab_id, "kept"] for line in capsys.readouterr().out.splitlines()
        )
        assert _cli("net", "down", lab_id) == 0
        assert _leftovers(lab_id) == []
        assert _cli("net", "down", lab_id) == 2
    finally:
        down_all(lab_id)

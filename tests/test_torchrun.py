"""Multi-node with torchrun on the emulated cluster, and the same script under ``commfuse launch``.

Two emulated hosts (network namespaces, 1 Gbit/s links), two ranks each. Each host runs its own
``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` inside its namespace, bound to
its own address, with gloo pointed at its interface. Host 0 hosts the rendezvous store
(``--rdzv-conf is_host=1``: inside a namespace torchrun cannot match the endpoint to its own
hostname, see DESIGN.md). The script all-reduces a tensor and checks its placement; the very same
file then runs under ``commfuse launch --hosts 2 --ranks-per-host 2 --link 1gbit``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from commfuse.cluster.env import CONTRACT_VARS
from commfuse.cluster.netlab import Netlab
from commfuse.cluster.topology import Topology

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

SCRIPT = str(Path(__file__).parent / "scripts" / "all_reduce_check.py")
RDZV_PORT = 29400  # the lab's namespaces are fresh: nothing else listens there
RESULT = re.compile(r"ALL_REDUCE_OK (.*)$")


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def results(output: str) -> dict[int, dict[str, str]]:
    """``{rank: {field: value}}`` from the ALLREDUCE_OK lines (prefixed or not)."""
    found: dict[int, dict[str, str]] = {}
    for line in output.splitlines():
        if match := RESULT.search(line):
            fields = dict(item.split("=", 1) for item in match.group(1).split())
            found[int(fields["rank"])] = fields
    return found


@pytest.mark.timeout(150)
def test_torchrun_one_agent_per_emulated_host() -> None:
    marker = f"cftest-{uuid.uuid4().hex[:10]}"
    topology = Topology(num_hosts=2, ranks_per_host=2, link_mbit=1000)
    base_env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    with Netlab(topology) as lab:
        endpoint = f"{lab.address(0)}:{RDZV_PORT}"
        procs: list[subprocess.Popen[str]] = []
        try:
            for k in range(topology.num_hosts):
                argv = [
                    "ip", "netns", "exec", lab.namespace(k),
                    sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(k),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", marker,
                    "--local-addr", lab.address(k), "--max-restarts", "0",
                    *(["--rdzv-conf", "is_host=1"] if k == 0 else []),
                    SCRIPT, marker,
                ]  # fmt: skip
                env = {**base_env, "GLOO_SOCKET_IFNAME": lab.ifname(k), "OMP_NUM_THREADS": "1"}
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                        start_new_session=True,
                    )
                )
            outputs = [p.communicate(timeout=100)[0] for p in procs]
        finally:
            for p in procs:  # only when the test failed: stop each torchrun and its workers
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
    for k, (p, output) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"torchrun on host {k} exited {p.returncode}:\n{output}"
        got = results(output)
        # Node ranks follow the hosts: host k runs ranks 2k and 2k+1, in namespace k.
        assert sorted(got) == [2 * k, 2 * k + 1], output
        for rank, fields in got.items():
            assert fields["world"] == "4" and fields["sum"] == "10"
            assert fields["group_rank"] == str(k) and fields["host"] == str(k)
            assert fields["local_rank"] == str(rank % 2)
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(marker)


@pytest.mark.timeout(120)
def test_the_same_script_under_commfuse_launch() -> None:
    console = Path(sys.executable).with_name("commfuse")
    command = [str(console)] if console.exists() else [sys.executable, "-m", "commfuse.cli"]
    proc = subprocess.Popen(
        [*command, "launch", "--hosts", "2", "--ranks-per-host", "2", "--link", "1gbit", SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:  # Ctrl-C: the launcher stops its ranks and removes its lab
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    assert proc.returncode == 0, stderr
    got = results(stdout)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, fields in got.items():
        assert stdout.count(f"[rank {rank}] ALL_REDUCE_OK rank={rank} ") == 1
        assert fields["world"] == "4" and fields["sum"] == "10"
        assert fields["group_rank"] == fields["host"] == str(rank // 2)
        assert fields["local_rank"] == str(rank % 2)
        assert fields["master"].startswith("10.77.0.100:")
    assert "network not emulated" not in stderr

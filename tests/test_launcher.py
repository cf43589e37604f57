"""The local launcher, through ``launch()`` and the real ``commfuse launch`` command.

Ranks run the helper scripts in tests/scripts/. Every job is given a unique marker on its
command line (the ranks' grandchildren carry it too), so a test can prove that nothing of the job
is left running afterwards.
"""

from __future__ import annotations

import gc
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

from commfuse import cli
from commfuse.cluster import Topology, launch
from commfuse.cluster.launcher import script_command
from commfuse.cluster.store import host_store

SCRIPTS = Path(__file__).parent / "scripts"
PRINT_ENV = str(SCRIPTS / "print_env.py")
MISBEHAVE = str(SCRIPTS / "misbehave.py")
ALL_REDUCE = str(SCRIPTS / "all_reduce_check.py")

_console_script = Path(sys.executable).with_name("commfuse")
#: The installed ``commfuse`` command (or the same entry point through ``python -m``).
COMMFUSE = (
    [str(_console_script)]
    if _console_script.exists() and os.access(_console_script, os.X_OK)
    else [sys.executable, "-m", "commfuse.cli"]
)
#: A line of rank output: ``[rank N] text``.
RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")


def new_marker() -> str:
    return f"cftest-{uuid.uuid4().hex[:10]}"


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (zombies have none)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f"{pid}: {f.read().strip()}"
    except OSError as exc:
        return f"{pid}: {exc}"


def assert_exactly_running(marker: str, expected: list[int], within_s: float = 5.0) -> None:
    """The job's processes are exactly ``expected``, waited for up to ``within_s``.

    A process that has printed its pid is running, but a scan of /proc on a loaded machine has
    been seen to miss one (CI, once): a scan that disagrees is repeated before the test fails, and
    the failure shows what /proc says of every pid involved.
    """
    deadline = time.monotonic() + within_s
    while sorted(found := processes_with(marker)) != sorted(expected):
        if time.monotonic() > deadline:
            involved = sorted(set(found) | set(expected))
            raise AssertionError(
                f"job processes {sorted(found)} != expected {sorted(expected)}; /proc says:\n"
                + "\n".join(_describe(pid) for pid in involved)
            )
        time.sleep(0.1)


def assert_nothing_left(marker: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the job still alive: {left}"


def start_launch(*args: str, new_session: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*COMMFUSE, "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=new_session,
    )


def stop_launcher(proc: subprocess.Popen[str]) -> None:
    """Stop a launcher that overran, the way a user would (Ctrl-C), so it stops its ranks too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def commfuse_launch(*args: str, timeout_s: float = 80.0) -> subprocess.CompletedProcess[str]:
    proc = start_launch(*args)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        stop_launcher(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def rank_lines(text: str, prefix: str) -> dict[int, list[str]]:
    """``{rank: [text after the prefix, ...]}`` of the lines ``[rank N] PREFIX...``."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = RANK_LINE.match(line)
        if match and match.group(2).startswith(prefix):
            out.setdefault(int(match.group(1)), []).append(match.group(2)[len(prefix) :])
    return out


def summary_line(stderr: str) -> str:
    """The launcher's own last word: the last stderr line that is not rank output."""
    own = [ln for ln in stderr.splitlines() if ln.strip() and not RANK_LINE.match(ln)]
    assert own, f"the launcher said nothing on stderr:\n{stderr}"
    return own[-1]


def parse_all_reduce(stdout: str) -> dict[int, dict[str, str]]:
    lines = rank_lines(stdout, "ALL_REDUCE_OK ")
    return {
        rank: dict(item.split("=", 1) for item in texts[0].split()) for rank, texts in lines.items()
    }


# ---- the torchrun contract and output ---------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("hosts", "per_host"), [(1, 3), (2, 2)])
def test_every_rank_gets_the_torchrun_contract(hosts: int, per_host: int) -> None:
    out, err = io.StringIO(), io.StringIO()
    topology = Topology(num_hosts=hosts, ranks_per_host=per_host)
    # emulate=False: the 2-host layout on plain loopback (the netlab run is in test_torchrun).
    result = launch(
        script_command(PRINT_ENV, []), topology, emulate=False, timeout_s=30, stdout=out, stderr=err
    )
    assert result.ok and result.returncode == 0, err.getvalue()
    assert result.exit_codes == dict.fromkeys(range(hosts * per_host), 0)

    lines = rank_lines(out.getvalue(), "ENV ")
    assert sorted(lines) == list(range(hosts * per_host))
    envs = {rank: json.loads(texts[0]) for rank, texts in lines.items()}
    ports = set()
    for rank, env in envs.items():
        # The [rank N] prefix names the rank that printed the line.
        assert env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == str(hosts * per_host)
        assert env["LOCAL_RANK"] == str(rank % per_host)
        assert env["LOCAL_WORLD_SIZE"] == str(per_host)
        assert env["GROUP_RANK"] == str(rank // per_host)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert len({env["pid"] for env in envs.values()}) == hosts * per_host


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_world_size_one_runs_a_torchrun_script() -> None:
    proc = commfuse_launch("--nproc", "1", ALL_REDUCE)
    assert proc.returncode == 0, proc.stderr
    results = parse_all_reduce(proc.stdout)
    assert list(results) == [0]
    assert results[0]["world"] == "1" and results[0]["sum"] == "1"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_two_jobs_at_once_get_their_own_ports() -> None:
    procs = [start_launch("--nproc", "2", ALL_REDUCE) for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=80) for p in procs]
    finally:
        for p in procs:
            stop_launcher(p)
    ports = []
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr
        results = parse_all_reduce(stdout)
        assert sorted(results) == [0, 1]
        assert all(r["world"] == "2" and r["sum"] == "3" for r in results.values())
        (port,) = {r["master"].rsplit(":", 1)[1] for r in results.values()}
        ports.append(port)
    assert ports[0] != ports[1]


@pytest.mark.timeout(30)
def test_hosted_stores_get_free_ports_and_close_each_descriptor_once() -> None:
    first, second = host_store(), host_store()
    try:
        assert first.port != second.port
        client = TCPStore("127.0.0.1", second.port, None, False, timeout=timedelta(seconds=10))
        client.set("key", "value")
        assert second.store is not None and second.store.get("key") == b"value"
        del client
    finally:
        first.close()
        second.close()
    # The descriptors the stores used are free again; whatever takes them next (here a pipe)
    # must not be closed behind its back when the old store objects are collected.
    read_fd, write_fd = os.pipe()
    try:
        del first, second
        gc.collect()
        os.fstat(read_fd)
        os.fstat(write_fd)
    finally:
        os.close(read_fd)
        os.close(write_fd)


# ---- failures: the culprit is named and every other rank is stopped ---------------------------


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "modes",
    [
        # Rank 1 fails before joining: rank 0 waits for it in init_process_group (default
        # timeout 30 minutes), rank 2 sleeps 10 minutes.
        ["--default", "sleep", "--rank", "0=wait-group", "--rank", "1=raise"],
        # Rank 1 fails inside the group (torch prefixes its traceback with "[rank1]: "); the
        # others are in the group but not in a collective, so nothing but us stops them.
        ["--default", "group-sleep", "--rank", "1=group-raise"],
    ],
    ids=["before-joining", "in-group"],
)
def test_a_rank_that_raises_stops_the_job_and_is_named(modes: list[str]) -> None:
    marker = new_marker()
    start = time.monotonic()
    proc = commfuse_launch("--nproc", "3", MISBEHAVE, marker, *modes, "--child")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    summary = summary_line(proc.stderr)
    assert summary.startswith("commfuse launch: rank 1 ")
    assert summary.endswith(" failed with exit code 1: ValueError: boom from rank 1")
    # Before it, how the others ended: asleep in their group, so stopped.
    assert (
        "commfuse launch: the other ranks: rank 0 was stopped by the launcher, "
        "rank 2 was stopped by the launcher"
    ) in proc.stderr
    # The traceback itself reached the terminal, prefixed with the rank.
    assert re.search(r"^\[rank 1\] .*Traceback \(most recent call last\):$", proc.stderr, re.M)
    # Well before the 30-minute backend timeout and the 10-minute sleeps, even on a loaded CI.
    assert elapsed < 45, f"the other ranks were not stopped promptly ({elapsed:.1f} s)"
    assert sorted(rank_lines(proc.stdout, "READY ")) == [0, 1, 2]
    assert_nothing_left(marker)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_rank_that_exits_with_a_code_is_named() -> None:
    marker = new_marker()
    err = io.StringIO()
    result = launch(
        script_command(MISBEHAVE, [marker, "--default", "sleep", "--rank", "1=exit3"]),
        Topology(ranks_per_host=2),
        timeout_s=30,
        stdout=io.StringIO(),
        stderr=err,
    )
    assert not result.ok and result.returncode == 1
    assert result.failure is not None
    assert (result.failure.rank, result.failure.exit_code) == (1, 3)
    assert result.exit_codes[1] == 3 and result.exit_codes[0] != 0  # rank 0 was stopped
    assert result.stopped == [0]
    assert result.endings() == "rank 0 was stopped by the launcher"
    assert result.failure.describe().startswith("rank 1 (host 0) failed with exit code 3")
    assert_nothing_left(marker)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "late"), [("mismatch", "0"), ("mismatch-caught", "0"), ("mismatch-caught", "4")]
)
def test_ranks_whose_collective_passed_its_deadline_leave_instead_of_hanging(
    mode: str, late: str
) -> None:
    """gloo keeps a timed-out collective pending, and the interpreter's teardown would wait for
    it until gloo's own 30-minute timeout: after a CommError, the process ends at exit. A rank
    that reaches its collective after the other rank gave up and left sees the peer gone
    (rank 1 late by twice the deadline forces what a loaded machine does by chance)."""
    marker = new_marker()
    start = time.monotonic()
    job = ["--nproc", "2", "--timeout", "90", MISBEHAVE, marker, "--default", mode]
    proc = commfuse_launch(*job, "--late", f"1={late}")
    elapsed = time.monotonic() - start
    assert elapsed < 45, f"the ranks did not leave ({elapsed:.1f} s): {proc.stderr}"
    if mode == "mismatch":  # uncaught: status 1, and the error names rank and operation
        assert proc.returncode == 1, proc.stderr
        assert "CommTimeoutError: rank 0, all_reduce" in proc.stderr
        assert "not finished within the 2 s deadline" in proc.stderr
    else:  # caught, and the script ended: status 0
        assert proc.returncode == 0, proc.stderr
        assert sorted(rank_lines(proc.stdout, "CAUGHT ")) == [0, 1]
    assert_nothing_left(marker)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_job_deadline_names_the_hung_ranks() -> None:
    marker = new_marker()
    start = time.monotonic()
    proc = commfuse_launch(
        "--nproc", "3", "--timeout", "2", MISBEHAVE, marker,
        "--default", "sleep", "--rank", "0=ok", "--child",
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    summary = summary_line(proc.stderr)
    assert summary.startswith("commfuse launch: rank 1 ")
    assert "ranks [1, 2] still running after the 2 s deadline" in summary
    assert elapsed < 40
    assert_nothing_left(marker)


def _netlab_names(lab_id: str) -> list[str]:
    """Namespaces and links of lab ``lab_id`` that still exist."""
    from commfuse.cluster.netlab import list_labs

    return [
        name
        for lab in list_labs()
        if lab["lab_id"] == lab_id
        for name in [*lab["namespaces"], *lab["links"]]
    ]


#: Two ranks on one host, and one rank on each of two emulated hosts.
TWO_RANK_LAYOUTS = [
    pytest.param(["--nproc", "2"], id="local"),
    pytest.param(
        ["--hosts", "2", "--ranks-per-host", "1", "--link", "1gbit"],
        id="netlab",
        marks=pytest.mark.netlab,
    ),
]


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_ctrl_c_stops_every_rank_and_leaves_nothing(layout: list[str]) -> None:
    emulated = "--hosts" in layout
    marker = new_marker()
    with SleepingJob(layout, marker) as job:
        # The launcher leads its own process group, as a terminal's foreground job: Ctrl-C
        # signals the whole group.
        os.killpg(job.proc.pid, signal.SIGINT)
        returncode = job.proc.wait(timeout=15)
    assert returncode == 130, job.stderr
    assert "interrupted" in summary_line(job.stderr)
    assert_nothing_left(marker)
    if emulated:
        # Both hosts' ranks ran in one emulated cluster, which is gone with them.
        (lab_id,) = job.labs
        assert lab_id.startswith("cfuse")
        assert _netlab_names(lab_id) == []
    else:
        assert job.labs == {"-"}


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_launcher_killed_takes_its_ranks_and_network_with_it(layout: list[str]) -> None:
    # SIGKILL leaves the launcher no chance to clean up; its ranks lead their own sessions, so
    # only the job's watchdog can stop them (and their children) and remove the namespaces.
    marker = new_marker()
    with SleepingJob(layout, marker) as job:
        job.proc.kill()
        assert job.proc.wait(timeout=15) == -signal.SIGKILL
        assert_nothing_left(marker, within_s=15)
    if "--hosts" in layout:
        (lab_id,) = job.labs
        deadline = time.monotonic() + 15
        while _netlab_names(lab_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _netlab_names(lab_id) == []


class SleepingJob:
    """``commfuse launch`` of two ranks that each start a child and sleep, in a session of its
    own; entered once every rank has said READY and /proc shows exactly the job's processes."""

    def __init__(self, layout: list[str], marker: str) -> None:
        self.layout, self.marker = layout, marker
        self.labs: set[str] = set()
        self.pids: list[int] = []
        self._stderr: list[str] = []

    @property
    def stderr(self) -> str:
        for reader in self._readers:
            reader.join(timeout=5)
        return "".join(self._stderr)

    def __enter__(self) -> SleepingJob:
        self.proc = start_launch(
            *self.layout, MISBEHAVE, self.marker, "--default", "sleep", "--child", new_session=True
        )
        lines: queue.Queue[str] = queue.Queue()

        def read_stdout() -> None:
            for line in self.proc.stdout or []:
                lines.put(line)

        self._readers = [
            threading.Thread(target=read_stdout, daemon=True),
            threading.Thread(
                target=lambda: self._stderr.extend(self.proc.stderr or []), daemon=True
            ),
        ]
        for reader in self._readers:
            reader.start()
        try:
            deadline = time.monotonic() + 30
            while len(self.pids) < 4:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if match := re.search(r"READY rank=\d+ pid=(\d+) child=(\d+) lab=(\S+)", line):
                    self.pids += [int(match.group(1)), int(match.group(2))]
                    self.labs.add(match.group(3))
            assert_exactly_running(self.marker, [self.proc.pid, *self.pids])
        except BaseException:
            stop_launcher(self.proc)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_launcher(self.proc)


# ---- bad input: one line saying what to change, exit code 2, nothing started -------------------


def _children() -> set[int]:
    me = str(os.getpid())
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        kids.add(int(entry))
            except (OSError, IndexError):
                continue
    return kids


def _my_labs() -> list[str]:
    if shutil.which("ip") is None:
        return []
    from commfuse.cluster.netlab import list_labs

    return [lab["lab_id"] for lab in list_labs() if lab.get("pid") == os.getpid()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--nproc", "2", "/nonexistent/train.py"], "does not exist"),
        (["--nproc", "2", "--link", "0mbit", PRINT_ENV], "more than 0"),
        (["--hosts", "2", "--link", "0", PRINT_ENV], "bad link rate '0'"),
        (["--hosts", "2", "--link", "fast", PRINT_ENV], "like 100mbit, 1gbit"),
        (["--nproc", "1000", PRINT_ENV], "more than this machine can hold"),
        (["--hosts", "100", PRINT_ENV], "more than the 64"),
        (["--hosts", "0", PRINT_ENV], "--hosts must be at least 1"),
        (["--nproc", "0", PRINT_ENV], "--nproc must be at least 1"),
        (["--hosts", "2", "--nproc", "3", PRINT_ENV], "does not divide evenly"),
        (["--hosts", "2", "--ranks-per-host", "2", "--nproc", "3", PRINT_ENV], "--nproc 3 !="),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before_kids, before_labs = _children(), _my_labs()
    assert cli.main(["launch", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("commfuse launch: ") and hint in lines[0], lines[0]
    assert captured.out == ""
    assert _children() <= before_kids
    assert _my_labs() == before_labs


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_bad_input_through_the_command() -> None:
    proc = commfuse_launch("--nproc", "2", "--link", "1gbit", "/nonexistent/train.py")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "commfuse launch: script '/nonexistent/train.py' does not exist; "
        "give the path of a Python file (or -m module)"
    ]


def test_no_emulate_drops_the_link_rate_nothing_would_enforce() -> None:
    """--no-emulate runs on plain loopback: the topology every table and record describes has
    no link rate then, not the --link that nothing caps."""
    import argparse

    from commfuse.cli.common import topology_from_args

    args = argparse.Namespace(hosts=4, ranks_per_host=None, link="100mbit", no_emulate=True)
    topology = topology_from_args(args, nproc=4)
    assert topology.link_mbit is None and topology.num_hosts == 4
    assert "unshaped" in topology.describe()
    args.no_emulate = False
    from commfuse.cluster.netlab import netlab_unavailable_reason

    shaped = netlab_unavailable_reason() is None
    assert topology_from_args(args, nproc=4).link_mbit == (100.0 if shaped else None)
    args.link = None
    assert topology_from_args(args, nproc=4).link_mbit is None

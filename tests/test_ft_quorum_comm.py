"""The compressors' communicator over torchft's quorum (``commfuse.ft.quorum_comm``).

On the emulated cluster (one rank per host, each host's link its own veth), with the real
reconfigurable gloo group that torchft's Manager drives (``AlarmedProcessGroupGloo``, set up
by its ``configure`` in a real TCPStore):

* ``all_reduce`` leaves the same bits on every replica, a sum within fp32 rounding of the
  exact one (three roundings of the magnitudes' sum), for messages of odd sizes and
  non-integer values (where the order of a sum shows in the last bits);
* what each replica puts on its link for one ``all_reduce`` of S bytes is a ring
  all-reduce's ``2 (n - 1) / n x S`` (plus the headers and acknowledgements of TCP), not
  the ``(n - 1) x S`` of an all-gather of every replica's message; read from the host
  interface's own counter (``/proc/self/net/dev`` in the host's network namespace).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commfuse.cluster import Topology, run

pytest.importorskip("torchft")

#: Elements of the timed message: large beside the traffic of the quorum's store.
NUMEL = 1_000_003


def _tx_bytes() -> int:
    """Bytes sent so far on this host's link (the interface gloo uses, in this namespace)."""
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == ifname:
                return int(fields.split()[8])
    raise AssertionError(f"no interface {ifname} in /proc/self/net/dev")


def _quorum_all_reduce(numels: list[int]) -> dict[str, Any]:
    from commfuse.ft.process_group import AlarmedProcessGroupGloo
    from commfuse.ft.quorum_comm import QuorumComm

    rank, world = dist.get_rank(), dist.get_world_size()
    group = AlarmedProcessGroupGloo(timeout=timedelta(seconds=30))
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/quorum-comm-test"
    group.configure(store, f"replica_{rank:03d}", rank, world)
    comm = QuorumComm(group)
    comm.at_quorum(rank, world)
    gen = torch.Generator().manual_seed(rank)
    digests, errors, sent = [], [], []
    for numel in [*numels, NUMEL]:
        # Values over six orders of magnitude: a sum's order changes its last bits.
        exponents = torch.randint(-3, 3, (numel,), generator=gen)
        x = torch.randn(numel, generator=gen) * 10.0**exponents
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)  # on the world's group: the exact reference, in fp64
        exact = torch.stack(parts).double().sum(0)
        scale = torch.stack(parts).double().abs().sum(0)  # what bounds a sum's rounding
        dist.barrier()
        before, handed = _tx_bytes(), comm.bytes_sent
        comm.all_reduce(x)
        # Once every replica holds the sum, every byte of it has left its sender's queue
        # (gloo's send completes when the kernel holds the bytes, before the link carries them).
        dist.barrier()
        sent.append((_tx_bytes() - before, comm.bytes_sent - handed))
        digests.append(hashlib.sha256(x.numpy().tobytes()).hexdigest())
        errors.append(float(((x.double() - exact).abs() / scale).max()))
    dist.barrier()
    return {"digests": digests, "errors": errors, "sent": sent}


@pytest.mark.netlab
@pytest.mark.timeout(180)
def test_quorum_all_reduce_gives_every_replica_the_same_bits_and_sends_a_ring_all_reduce() -> None:
    hosts = 4
    numels = [1, 3, 1000, 4097]
    results = run(
        _quorum_all_reduce, numels, net=Topology(num_hosts=hosts, link_mbit=1000), emulate=True
    )
    for i in range(len(numels) + 1):
        assert len({r["digests"][i] for r in results}) == 1, (i, [r["digests"][i] for r in results])
    # Three fp32 additions: at most 3 x 2^-24 of the sum of the magnitudes.
    assert max(e for r in results for e in r["errors"]) < 3 * 2**-24
    message = NUMEL * 4
    ring = 2 * (hosts - 1) / hosts * message
    for r in results:
        on_link, handed = r["sent"][-1]
        assert handed == message  # the message, counted once as handed to gloo
        # TCP's headers and acknowledgements add about 1% at this MTU; an all-gather would
        # send (hosts - 1) x message = twice the ring's bytes here.
        assert ring <= on_link <= 1.1 * ring, (on_link, ring)


class _Struck(Exception):
    """The fault, in place of the SIGKILL that a pool of ranks cannot survive."""


def _struck_at_issue(late_s: float) -> bool:
    """Rank 1 meets a fault where a kill of phase ``allreduce`` strikes (``on_issue``) and
    dies ``late_s`` later (it raises the alarm, as a failed replica does); whether rank 0's
    all-gather finished."""
    from commfuse.ft.process_group import AlarmedProcessGroupGloo, CollectiveAbandoned
    from commfuse.ft.quorum_comm import QuorumComm

    rank = dist.get_rank()
    group = AlarmedProcessGroupGloo(timeout=timedelta(seconds=5))
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/struck-test"
    group.configure(store, f"replica_{rank:03d}", rank, 2)
    comm = QuorumComm(group)
    comm.at_quorum(rank, 2)
    output, mine = torch.zeros(8), torch.full((4,), float(rank))

    def strike() -> None:
        time.sleep(late_s)
        raise _Struck

    comm.on_issue = strike if rank == 1 else None
    try:
        comm.all_gather(output, mine)
    except _Struck:
        group.raise_alarm()
    except (CollectiveAbandoned, RuntimeError):  # the alarm, or gloo saw rank 1 go first
        pass
    else:
        return True
    return False


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_fault_at_issue_strikes_before_any_of_the_collective_leaves() -> None:
    # However late the kill lands after the fault's point, the peer cannot finish: nothing of
    # the victim's part was handed to gloo. (Handed over first, this message of 16 bytes
    # reached the peer during the kill's delay, and its all-gather finished.)
    finished = run(_struck_at_issue, 0.5, world_size=2)
    assert finished == [False, False]


def test_a_failed_configuration_leaves_a_group_of_one_member_not_an_assertion() -> None:
    """torchft drops the old group before it builds the new one: when building fails (a peer
    died during the quorum), no group is configured and the Manager holds the step's error.
    The replica still reads the quorum's size for the step it will not commit; ``size()``
    asserts there, ``members()`` answers 1."""
    from commfuse.ft.process_group import AlarmedProcessGroupGloo

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    group = AlarmedProcessGroupGloo(timeout=timedelta(seconds=1))
    group.configure(f"127.0.0.1:{server.port}/ok", "replica_000", 0, 1)
    assert group.members() == 1 and group.size() == 1
    with socket_bound() as port, pytest.raises((RuntimeError, OSError, TimeoutError)):
        # A port that accepts nothing: the store client cannot connect.
        group.configure(f"127.0.0.1:{port}/gone", "replica_000", 0, 2, quorum_id=2)
    with pytest.raises(AssertionError, match="not initialized"):
        group.size()
    assert group.members() == 1


@contextlib.contextmanager
def socket_bound() -> Iterator[int]:
    """A local port bound but not listening: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]

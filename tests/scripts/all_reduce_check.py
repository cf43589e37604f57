"""A plain torchrun script: all-reduce a tensor and check the result and this rank's placement.

It runs unchanged under ``torchrun`` and ``commfuse launch``. Each rank works out which emulated
host it is on from the address of its gloo interface (GLOO_SOCKET_IFNAME; host k of a netlab has
10.77.0.<100+k>), checks that GROUP_RANK and LOCAL_RANK agree with RANK, and gathers every rank's
(group rank, host) to check that each host's ranks form one group. It prints one line:

    ALLREDUCE_OK rank=R world=W group_rank=G local_rank=L host=H sum=S master=ADDR:PORT

(H is -1 on plain loopback) and exits non-zero on any mismatch.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

import torch
import torch.distributed as dist

SIOCGIFADDR = 0x8915


def interface_addr(ifname: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def emulated_host() -> int:
    """The netlab host index this rank runs on, or -1 when not inside an emulated host."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or ifname == "lo":
        return -1
    addr = interface_addr(ifname)
    if not addr.startswith("10.77.0."):
        return -1
    return int(addr.rsplit(".", 1)[1]) - 100  # netlab.FIRST_HOST_OCTET


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    group_rank = int(os.environ["GROUP_RANK"])
    host = emulated_host()
    if group_rank != rank // local_world or local_rank != rank % local_world:
        raise SystemExit(
            f"placement mismatch: RANK={rank} GROUP_RANK={group_rank} LOCAL_RANK={local_rank} "
            f"LOCAL_WORLD_SIZE={local_world}"
        )

    dist.init_process_group("gloo")
    assert dist.get_rank() == rank and dist.get_world_size() == world
    numel = 1 << 16
    tensor = torch.full((numel,), float(rank + 1))
    dist.all_reduce(tensor)
    expected = world * (world + 1) / 2
    if not torch.equal(tensor, torch.full((numel,), expected)):
        raise SystemExit(
            f"all_reduce wrong: got {sorted(set(tensor.tolist()))}, expected {expected}"
        )

    mine = torch.tensor([rank, group_rank, local_rank, host], dtype=torch.int64)
    table = [torch.zeros(4, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(table, mine)
    rows = [row.tolist() for row in table]
    hosts = {row[3] for row in rows}
    if -1 not in hosts and len(hosts) != len({row[1] for row in rows}):
        raise SystemExit(f"hosts and groups do not match one to one: {rows}")
    for r, (got_rank, g, lr, h) in enumerate(rows):
        same_host = {row[1] for row in rows if row[3] == h}
        if (
            got_rank != r
            or (h >= 0 and same_host != {g})
            or g != r // local_world
            or lr != r % local_world
        ):
            raise SystemExit(f"ranks disagree on placement: {rows}")
    dist.destroy_process_group()
    # One write of the whole line: ranks of one torchrun agent share its stdout pipe, and
    # print() writes the text and the newline separately, so two ranks' lines could interleave
    # ("...:38195ALLREDUCE_OK rank=0 ..." on one line, seen once in CI).
    sys.stdout.write(
        f"ALL_REDUCE_OK rank={rank} world={world} group_rank={group_rank} local_rank={local_rank} "
        f"host={host} sum={tensor[0].item():g} "
        f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

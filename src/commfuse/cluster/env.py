"""The torchrun environment contract, so a script written for torchrun runs unchanged here.

torchrun gives every worker RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node
index), ROLE_RANK/ROLE_WORLD_SIZE, MASTER_ADDR/MASTER_PORT and the TORCHELASTIC_* variables. We
set the same. Like torchrun's agent, the launcher hosts the rendezvous store itself and sets
TORCHELASTIC_USE_AGENT_STORE=True, so rank 0 connects as a client instead of opening a listening
socket on every interface (TCPStore binds to all interfaces when it creates its own socket).
"""

from __future__ import annotations

import os

from commfuse.cluster.topology import Topology

#: Variables that describe a rank's place in a job; cleared before a launch so that a job
#: started from inside another job does not inherit stale values.
CONTRACT_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GLOO_SOCKET_IFNAME",
    "COMMFUSE_NUM_HOSTS",
    "COMMFUSE_LINK_MBIT",
    "COMMFUSE_NETLAB",
)


def rank_env(
    topology: Topology,
    rank: int,
    *,
    master_addr: str,
    master_port: int,
    run_id: str,
    socket_ifname: str | None,
    netlab_id: str | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one rank: ``base`` (default os.environ) plus the contract."""
    env = {
        k: v for k, v in (os.environ if base is None else base).items() if k not in CONTRACT_VARS
    }
    host = topology.host_of(rank)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(topology.world_size),
        LOCAL_RANK=str(topology.local_rank_of(rank)),
        LOCAL_WORLD_SIZE=str(topology.ranks_per_host),
        GROUP_RANK=str(host),
        GROUP_WORLD_SIZE=str(topology.num_hosts),
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(topology.world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        COMMFUSE_NUM_HOSTS=str(topology.num_hosts),
        PYTHONUNBUFFERED="1",
    )
    # torchrun's default: N ranks on one machine must not each start a thread per core.
    env.setdefault("OMP_NUM_THREADS", "1")
    if socket_ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
    if topology.link_mbit is not None and netlab_id is not None:
        env["COMMFUSE_LINK_MBIT"] = f"{topology.link_mbit:g}"
    if netlab_id is not None:
        env["COMMFUSE_NETLAB"] = netlab_id
    return env

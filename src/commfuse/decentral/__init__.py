"""Decentralized training: gossip with neighbours instead of an all-reduce over every rank.

A topology (``topology.py``) is data: for round t, every rank's peers and weights and the
mixing matrix W(t): ``Ring``, ``Torus``, Bagua's ``ShiftOne``, SGP's one-peer ``Exponential``
graph, or any ``Explicit`` matrices. ``GossipAveraging`` (``gossip.py``) is D-PSGD's
averaging (Lian et al., NeurIPS 2017) over an undirected topology; ``PushSum``
(``push_sum.py``) is SGP's push-sum (Assran et al., ICML 2019) over a directed, time-varying
one; ``ChocoGossip`` (``choco.py``) gossips compressed messages (Koloskova et al., ICML
2019). All exchange the flat model with the communicator's deadline-bounded point-to-point
calls (``exchange.py``) every ``every`` steps, counted in ``comm.stats``. ``GossipConfig``
and ``PushSumConfig`` (``config.py``) are the typed configs a training run takes.
"""

from commfuse.decentral.choco import ChocoGossip
from commfuse.decentral.config import DecentralMethod, GossipConfig, PushSumConfig
from commfuse.decentral.gossip import GossipAveraging, Rounds
from commfuse.decentral.push_sum import PushSum
from commfuse.decentral.topology import (
    Edges,
    Explicit,
    Exponential,
    Ring,
    ShiftOne,
    Topology,
    Torus,
    bagua_shift_one_peer,
    sgp_offsets,
)

__all__ = [
    "ChocoGossip",
    "DecentralMethod",
    "Edges",
    "Explicit",
    "Exponential",
    "GossipAveraging",
    "GossipConfig",
    "PushSum",
    "PushSumConfig",
    "Ring",
    "Rounds",
    "ShiftOne",
    "Topology",
    "Torus",
    "bagua_shift_one_peer",
    "sgp_offsets",
]

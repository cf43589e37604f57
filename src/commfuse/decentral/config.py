"""Decentralized methods as typed configs, their names on the command line.

``GossipConfig`` is D-PSGD's gossip averaging (``gossip.py``), ``PushSumConfig`` SGP's
push-sum (``push_sum.py``); each names its topology (``topology.py``) and how many steps lie
between two rounds, and ``build`` makes the averaging object for a communicator and a model.
On the command line: ``gossip:topology=ring,every=4``, ``push-sum:topology=exponential``;
a gossip with a compressor runs CHOCO-Gossip (``gossip:topology=ring,compressor=int8``).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from typing import ClassVar, Literal

import torch

from commfuse.comm import Communicator
from commfuse.compress.base import Compressor
from commfuse.compress.message import MessageCompressor
from commfuse.decentral.choco import ChocoGossip
from commfuse.decentral.gossip import GossipAveraging, Rounds
from commfuse.decentral.push_sum import PushSum
from commfuse.decentral.topology import TOPOLOGIES

TopologyName = Literal["ring", "torus", "shift_one", "exponential"]


class DecentralMethod(abc.ABC):
    """A decentralized method's typed config (``GossipConfig``, ``PushSumConfig``)."""

    #: The method's name on the command line.
    name: ClassVar[str]
    #: Resuming continues bit for bit: the round counter (and PushSum's weight) is saved.
    resume_caveat: ClassVar[str | None] = None

    topology: TopologyName
    every: int
    final_average: bool

    def _check(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(
                f"{self.name}: topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}"
            )
        if self.every < 1:
            raise ValueError(f"{self.name}: every must be at least 1 step, got {self.every}")

    @abc.abstractmethod
    def build(self, params: Iterable[torch.Tensor], comm: Communicator) -> Rounds:
        """The averaging object of this rank's ``params`` over ``comm``'s ranks."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GossipConfig(DecentralMethod):
    """D-PSGD (Lian et al., NeurIPS 2017): a local step, then the model averaged with the
    topology's neighbours every ``every`` steps; no all-reduce."""

    name: ClassVar[str] = "gossip"

    topology: TopologyName = "shift_one"
    """The graph (``topology.py``): ring, torus, shift_one (one peer a round, Bagua's), or
    exponential (SGP's one-peer graph, whose W(t) is doubly stochastic too)."""
    every: int = 1
    """Steps between two gossip rounds."""
    final_average: bool = True
    """Average the replicas exactly once when training ends (one all-reduce of the model),
    so the run ends with the consensus model, the one the paper evaluates."""
    compressor: Compressor | None = None
    """CHOCO-Gossip (``choco.py``) with this compressor's messages (int8, topk, ...; on ring
    or torus); None: whole models."""
    gamma: float = 0.5
    """CHOCO's consensus step size, in (0, 1] (with a compressor only)."""

    def __post_init__(self) -> None:
        self._check()
        if self.compressor is None:
            if self.gamma != 0.5:
                raise ValueError("gossip: gamma is CHOCO's step size; it needs a compressor")
            return
        if not isinstance(self.compressor, MessageCompressor):
            raise ValueError(
                f"gossip: CHOCO needs a compressor with a message of its own (int8, int4, "
                f"qsgd, sign, topk, ...), got {type(self.compressor).__name__}"
            )
        if self.topology not in ("ring", "torus"):
            raise ValueError(
                f"gossip: a compressor (CHOCO) needs a fixed topology, ring or torus, got "
                f"{self.topology!r}"
            )
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gossip: gamma must be in (0, 1], got {self.gamma}")

    def build(self, params: Iterable[torch.Tensor], comm: Communicator) -> Rounds:
        topology = TOPOLOGIES[self.topology](comm.world_size)
        if isinstance(self.compressor, MessageCompressor):
            return ChocoGossip(
                params, comm, topology, self.compressor, gamma=self.gamma, every=self.every
            )
        return GossipAveraging(
            params, comm, TOPOLOGIES[self.topology](comm.world_size), every=self.every
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushSumConfig(DecentralMethod):
    """SGP (Assran et al., ICML 2019): push-sum over a directed, time-varying graph, the
    parameters de-biased by the push-sum weight."""

    name: ClassVar[str] = "push-sum"

    topology: TopologyName = "exponential"
    """The graph (``topology.py``); SGP's is the one-peer exponential graph."""
    every: int = 1
    """Steps between two push-sum rounds."""
    final_average: bool = True
    """Average the replicas exactly once when training ends (one all-reduce of the model)."""

    def __post_init__(self) -> None:
        self._check()

    def build(self, params: Iterable[torch.Tensor], comm: Communicator) -> Rounds:
        return PushSum(params, comm, TOPOLOGIES[self.topology](comm.world_size), every=self.every)

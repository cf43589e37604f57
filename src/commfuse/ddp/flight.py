"""One synchronized step's reduction in flight: the buckets it launched and their handles.

With ``staleness=0`` a flight lands (is waited for and copied into ``.grad``) at the end of
its own backward. With ``staleness=1`` (Pipe-SGD: Li, Ben-Nun, Bandera et al., "Pipe-SGD: A
Decentralized Pipelined SGD Framework for Distributed Deep Net Training", NeurIPS 2018) it
lands at the end of the NEXT backward, so its collectives run while that step computes: the
step time becomes about max(compute, communication) instead of compute plus the exposed part
of communication, at the price of every update using the gradient of the weights one step
earlier. Each bucket then has two flat buffers: the flight holds snapshots of the buckets
pointing at the buffer it launched, while the next backward fills the other one.

Two limits to know. Where ranks share cores, the CPU that the collectives and a compressor use
now slows the overlapped compute instead of being waited for, so the step falls short of the
compute floor. And the delay costs learning early in training, while consecutive gradients
differ most: it stays off by default, and suits runs with a smaller learning rate or past the
first fast descent.

A flight is also what a checkpoint must not lose: ``landed()`` waits for it and keeps its
averaged buffers and its NaN/Inf verdicts, which ``DataParallel.engine_state_dict`` stores and
a resumed run applies at its first step, as the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from commfuse.comm import Handle
from commfuse.ddp.buckets import Bucket


@dataclasses.dataclass
class Flight:
    """Buckets launched in one synchronized step, in launch order, and their handles."""

    step: int
    buckets: list[Bucket] = dataclasses.field(default_factory=list)
    handles: list[Handle] = dataclasses.field(default_factory=list)
    launched_after: list[int] = dataclasses.field(default_factory=list)
    """Per bucket, how many gradients had arrived when it was launched."""
    poisoned: bool = False
    """A bucket of this step was non-finite: later compressed buckets must not touch state."""

    def landed(self) -> Flight:
        """This flight with every handle waited for (results kept)."""
        results = [h.result() for h in self.handles]
        return dataclasses.replace(self, handles=[Handle.completed(r) for r in results])

    def state_dict(self) -> dict[str, Any]:
        """A landed flight's averaged buffers and verdicts (``landed()`` first)."""
        return {
            "step": self.step,
            "grads": [bucket.flat.clone() for bucket in self.buckets],
            "results": [handle.result() for handle in self.handles],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], buckets: list[Bucket]) -> Flight:
        """The landed flight of ``state`` on this engine's buckets (same layout)."""
        grads: list[torch.Tensor] = state["grads"]
        if [g.numel() for g in grads] != [b.flat.numel() for b in buckets]:
            raise ValueError(
                "checkpointed gradient in flight does not match the bucket layout: "
                f"{[g.numel() for g in grads]} vs {[b.flat.numel() for b in buckets]} elements"
            )
        return cls(
            step=int(state["step"]),
            buckets=[
                dataclasses.replace(b, flat=g.clone()) for b, g in zip(buckets, grads, strict=True)
            ],
            handles=[Handle.completed(r) for r in state["results"]],
        )

"""A model as the simulator sees it, ``ModelProfile``: per-layer parameters, FLOPs, memory
traffic and the collectives a layer itself needs (tensor-parallel allreduces, embedding and
expert All-to-Alls). (The training side's ``commfuse.workloads.Workload`` is a model with its
data and optimizer that really trains; a profile only describes one.)

Everything is per rank and per step (one forward and backward of the rank's micro-batch).
``from_module`` reads a real ``nn.Module`` on the meta device: parameters and FLOPs come out of
PyTorch itself (``torch.utils.flop_counter``), and no memory is allocated, so a model far larger
than this machine can be described. ``commfuse.sim.builtins`` builds the standard shapes.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    # Only ``from_module`` runs torch, and imports it when called: the rest of the simulator is
    # arithmetic, and ``import commfuse.sim`` stays free of torch.
    import torch

GroupName = Literal["tp", "dp", "world"]
PhaseName = Literal["fwd", "bwd"]
_GROUPS: tuple[GroupName, ...] = typing.get_args(GroupName)
PHASES: tuple[PhaseName, ...] = typing.get_args(PhaseName)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerComm:
    """A collective a layer runs on its own activations, in forward or backward."""

    collective: str
    """all_reduce, all_to_all, all_gather, reduce_scatter, broadcast or reduce."""
    nbytes: int
    """The full buffer per rank, bytes (nccl-tests' S)."""
    group: GroupName = "tp"
    """tp (tensor-parallel group), dp (data-parallel / expert-parallel group) or world."""
    phase: PhaseName = "fwd"
    """fwd or bwd."""
    fusable: bool = True
    """Whether a fused operator can chunk the layer's compute with it (embedding + All-to-All,
    GEMM + AllReduce, GEMM + All-to-All: Punniyamurthy et al., SC24)."""

    def __post_init__(self) -> None:
        if self.group not in _GROUPS:
            raise ValueError(f"layer comm group must be one of {_GROUPS}, got {self.group!r}")
        if self.phase not in PHASES:
            raise ValueError(f"layer comm phase must be one of {PHASES}, got {self.phase!r}")
        if self.nbytes < 0:
            raise ValueError(f"layer comm nbytes must be >= 0, got {self.nbytes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layer:
    """One layer as a rank sees it."""

    name: str
    param_bytes: int = 0
    """Parameters this rank holds, bytes (after tensor-parallel or table sharding)."""
    fwd_flops: float = 0.0
    """Forward FLOPs on this rank."""
    bwd_flops: float = 0.0
    """Backward FLOPs on this rank (about 2x forward for matrix products)."""
    mem_bytes: float = 0.0
    """Memory traffic of the forward (lookups, element-wise work), bytes; backward moves as much.
    A layer takes max(FLOPs / rate, bytes / memory bandwidth)."""
    data_parallel: bool = True
    """Whether its gradients are averaged over the data-parallel group (False for sharded
    embedding tables and experts)."""
    comms: tuple[LayerComm, ...] = ()

    def __post_init__(self) -> None:
        for name in ("param_bytes", "fwd_flops", "bwd_flops", "mem_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"layer {self.name!r}: {name} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A model's layers in forward order, and how it is split over ranks."""

    name: str
    layers: tuple[Layer, ...]
    tp_size: int = 1
    """Ranks per tensor-parallel group (consecutive ranks, inside a host where they fit)."""
    activation_bytes: float = 0.0
    """Activations kept for backward on one rank, bytes."""
    state_bytes_per_param_byte: float = 4.0
    """Memory per parameter byte: the parameter, its gradient and two Adam moments."""
    param_dtype_bytes: int = 4
    """Bytes per parameter element (gradients are communicated in this dtype)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"workload tp_size must be >= 1, got {self.tp_size}")
        if not self.layers:
            raise ValueError(f"workload {self.name!r} has no layers")

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def dp_param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers if layer.data_parallel)

    @property
    def flops(self) -> float:
        return sum(layer.fwd_flops + layer.bwd_flops for layer in self.layers)

    def memory_bytes(self) -> float:
        """What one rank must hold: model state and kept activations."""
        return self.param_bytes * self.state_bytes_per_param_byte + self.activation_bytes

    def scaled(self, *, flops: float = 1.0, nbytes: float = 1.0) -> ModelProfile:
        """The same model with every layer's FLOPs (and memory traffic) times ``flops`` and every
        parameter and message size times ``nbytes`` (for what-if questions and tests)."""
        layers = tuple(
            dataclasses.replace(
                layer,
                fwd_flops=layer.fwd_flops * flops,
                bwd_flops=layer.bwd_flops * flops,
                mem_bytes=layer.mem_bytes * flops,
                param_bytes=int(layer.param_bytes * nbytes),
                comms=tuple(
                    dataclasses.replace(c, nbytes=int(c.nbytes * nbytes)) for c in layer.comms
                ),
            )
            for layer in self.layers
        )
        return dataclasses.replace(self, layers=layers)


def from_module(
    module: torch.nn.Module,
    input_shape: Sequence[int],
    *,
    name: str | None = None,
    input_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """A data-parallel workload from a real module: one layer per leaf module that has
    parameters or FLOPs, in registration order (the order DDP buckets gradients in).

    The module is moved to the meta device (parameters keep their shapes, no memory), run
    forward and backward on a meta input of ``input_shape``, and PyTorch's FLOP counter is read
    per module, separately for the two passes. The input is ``input_dtype`` (None: float32);
    integer inputs (token ids, ``input_dtype=torch.long``) are drawn as zeros.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if input_dtype is None:
        input_dtype = torch.float32
    # Build big models under ``with torch.device("meta"):``; a real one is copied, not moved.
    on_meta = all(p.is_meta for p in module.parameters())
    model = module if on_meta else copy.deepcopy(module).to("meta")
    leaves = {
        qual: m for qual, m in model.named_modules() if not list(m.children()) and qual != ""
    } or {"": model}
    root = type(model).__name__

    def key(qual: str) -> str:
        return f"{root}.{qual}" if qual else root

    if input_dtype.is_floating_point:
        x = torch.randn(*input_shape, device="meta", dtype=input_dtype)
    else:
        x = torch.zeros(*input_shape, device="meta", dtype=input_dtype)
    # One counter for both passes (it attributes backward ops to modules through the hooks it
    # set in forward); the forward's counts are copied before backward runs.
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(x)
        fwd_counts = {k: dict(v) for k, v in counter.get_flop_counts().items()}
        out.float().sum().backward()
    total = counter.get_flop_counts()
    bwd_counts = {
        k: {op: n - fwd_counts.get(k, {}).get(op, 0) for op, n in v.items()}
        for k, v in total.items()
    }
    layers = []
    activations = 0.0
    for qual, leaf in leaves.items():
        params = sum(p.numel() * p.element_size() for p in leaf.parameters(recurse=False))
        fwd = float(sum(fwd_counts.get(key(qual), {}).values()))
        bwd = float(sum(bwd_counts.get(key(qual), {}).values()))
        if params == 0 and fwd == 0 and bwd == 0:
            continue
        layers.append(Layer(name=qual or root, param_bytes=params, fwd_flops=fwd, bwd_flops=bwd))
    # Each kept activation is about the size of the input per layer: a coarse but safe bound.
    activations = float(x.numel() * 4 * max(1, len(layers)))
    dtype_bytes = next((p.element_size() for p in model.parameters()), 4)
    return ModelProfile(
        name=name or root,
        layers=tuple(layers),
        activation_bytes=activations,
        param_dtype_bytes=dtype_bytes,
    )

"""Built-in workloads: the shapes whose communication the papers study.

All are weak-scaled: the batch per rank is fixed, so per-rank compute does not change with the
number of ranks, and what changes is the communication.

* ``transformer``: a GPT-style decoder trained data-parallel; per layer 12 h^2 parameters and
  24 b s h^2 + 4 b s^2 h forward FLOPs (Megatron-LM's count, Narayanan et al. 2021).
* ``tp_transformer``: the same blocks split over ``tp`` ranks (Megatron tensor parallelism): each
  block runs two allreduces of the activations (b s h elements) forward and two backward, the
  GEMM + AllReduce the fused operators overlap (Punniyamurthy et al., SC24).
* ``dlrm``: embedding tables sharded over all ranks plus data-parallel MLPs (Naumov et al. 2019).
  Each rank looks up its tables for the global batch and sends each rank its part: an
  All-to-All of b T d elements per rank forward and backward (the fused embedding + All-to-All
  of SC24 overlaps lookups with it, chunk by chunk).
* ``moe``: Transformer blocks whose MLP is a set of experts spread over the data-parallel group
  (GShard/Switch): a dispatch and a combine All-to-All of k b s h elements forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

from commfuse.sim.model import Layer, LayerComm, ModelProfile


def transformer(
    *,
    num_layers: int = 24,
    hidden: int = 2048,
    seq_len: int = 2048,
    batch_per_rank: int = 4,
    vocab: int = 50_304,
    tp: int = 1,
    dtype_bytes: int = 2,
    name: str = "transformer",
) -> ModelProfile:
    """A decoder-only Transformer (about 1.3 B parameters by default), data-parallel, and
    tensor-parallel over ``tp`` ranks when ``tp`` > 1."""
    if min(num_layers, hidden, seq_len, batch_per_rank, vocab, tp) < 1:
        raise ValueError(
            "transformer sizes (layers, hidden, seq_len, batch, vocab, tp) must be >= 1"
        )
    if hidden % tp:
        raise ValueError(f"hidden {hidden} must be divisible by tp {tp}")
    h, s, b = hidden, seq_len, batch_per_rank
    tokens = b * s
    act = tokens * h * dtype_bytes  # one activation tensor of the block's output
    embed = Layer(
        name="embed",
        param_bytes=vocab * h * dtype_bytes // tp,
        fwd_flops=0.0,
        bwd_flops=0.0,
        mem_bytes=act,
    )
    layers = [embed]
    for i in range(num_layers):
        comms: tuple[LayerComm, ...] = ()
        if tp > 1:
            # Megatron: one allreduce after attention and one after the MLP, each way.
            comms = tuple(
                LayerComm(collective="all_reduce", nbytes=act, group="tp", phase=phase)
                for phase in ("fwd", "fwd", "bwd", "bwd")
            )
        fwd = (24.0 * tokens * h * h + 4.0 * b * s * s * h) / tp
        layers.append(
            Layer(
                name=f"block{i}",
                param_bytes=12 * h * h * dtype_bytes // tp,
                fwd_flops=fwd,
                bwd_flops=2.0 * fwd,
                mem_bytes=8.0 * act,
                comms=comms,
            )
        )
    head = 2.0 * tokens * h * vocab / tp
    layers.append(Layer(name="lm_head", param_bytes=0, fwd_flops=head, bwd_flops=2 * head))
    return ModelProfile(
        name=name if tp == 1 else f"{name}-tp{tp}",
        layers=tuple(layers),
        tp_size=tp,
        activation_bytes=float(num_layers * 16 * act / tp),
        param_dtype_bytes=dtype_bytes,
        state_bytes_per_param_byte=8.0,  # bf16 weights and grads, fp32 master and Adam moments
    )


def tp_transformer(*, tp: int = 8, **kwargs: int) -> ModelProfile:
    """Tensor-parallel Transformer blocks (``transformer`` with ``tp`` ranks per group)."""
    return transformer(tp=tp, **kwargs)  # type: ignore[arg-type]


def dlrm(
    *,
    num_tables: int = 64,
    rows_per_table: int = 1_000_000,
    dim: int = 128,
    pooling: int = 32,
    batch_per_rank: int = 2048,
    bottom_mlp: tuple[int, ...] = (512, 256, 128),
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256, 1),
    num_dense: int = 13,
    world_size: int = 1,
) -> ModelProfile:
    """DLRM: ``num_tables`` tables of ``rows_per_table`` x ``dim`` fp32 rows spread over
    ``world_size`` ranks, ``pooling`` lookups per table per sample, MLPs data-parallel."""
    if min(num_tables, rows_per_table, dim, pooling, batch_per_rank, world_size) < 1:
        raise ValueError("dlrm sizes (tables, rows, dim, pooling, batch, world_size) must be >= 1")
    b = batch_per_rank
    exchange = b * num_tables * dim * 4  # this rank's share of every table's pooled output
    table_bytes = num_tables * rows_per_table * dim * 4 / world_size
    # Lookups of the global batch in this rank's tables: b P (T / P) pooling rows of d floats.
    lookups = float(b * num_tables * pooling * dim * 4)
    layers = [
        Layer(
            name="embeddings",
            param_bytes=int(table_bytes),
            mem_bytes=lookups,
            data_parallel=False,  # sharded, updated sparsely in place
            comms=(
                LayerComm(collective="all_to_all", nbytes=exchange, group="world", phase="fwd"),
                LayerComm(collective="all_to_all", nbytes=exchange, group="world", phase="bwd"),
            ),
        )
    ]
    width = num_dense
    for i, out in enumerate(bottom_mlp):
        layers.append(_linear(f"bottom{i}", width, out, b))
        width = out
    width = width + num_tables * (num_tables + 1) // 2  # pairwise dot-product interaction
    for i, out in enumerate(top_mlp):
        layers.append(_linear(f"top{i}", width, out, b))
        width = out
    return ModelProfile(
        name="dlrm",
        layers=tuple(layers),
        activation_bytes=float(b * (num_tables + 1) * dim * 4 * 4),
        state_bytes_per_param_byte=2.0,  # tables: weights and a row-wise Adagrad state
    )


def _linear(name: str, inp: int, out: int, batch: int) -> Layer:
    flops = 2.0 * batch * inp * out
    return Layer(name=name, param_bytes=(inp * out + out) * 4, fwd_flops=flops, bwd_flops=2 * flops)


def moe(
    *,
    num_layers: int = 12,
    hidden: int = 2048,
    seq_len: int = 2048,
    batch_per_rank: int = 2,
    experts_per_rank: int = 1,
    top_k: int = 2,
    dtype_bytes: int = 2,
) -> ModelProfile:
    """Transformer blocks whose MLPs are experts spread over the data-parallel group."""
    if min(num_layers, hidden, seq_len, batch_per_rank, experts_per_rank, top_k) < 1:
        raise ValueError("moe sizes must be >= 1")
    h, s, b = hidden, seq_len, batch_per_rank
    tokens = b * s
    routed = tokens * top_k * h * dtype_bytes
    layers = []
    for i in range(num_layers):
        attn = 8.0 * tokens * h * h + 4.0 * b * s * s * h
        layers.append(
            Layer(
                name=f"attn{i}",
                param_bytes=4 * h * h * dtype_bytes,
                fwd_flops=attn,
                bwd_flops=2 * attn,
                mem_bytes=4.0 * tokens * h * dtype_bytes,
            )
        )
        expert = 16.0 * tokens * top_k * h * h  # each routed token through a 4h MLP
        layers.append(
            Layer(
                name=f"experts{i}",
                param_bytes=8 * h * h * dtype_bytes * experts_per_rank,
                fwd_flops=expert,
                bwd_flops=2 * expert,
                data_parallel=False,
                comms=tuple(
                    LayerComm(collective="all_to_all", nbytes=routed, group="dp", phase=phase)
                    for phase in ("fwd", "fwd", "bwd", "bwd")
                ),
            )
        )
    return ModelProfile(
        name="moe",
        layers=tuple(layers),
        activation_bytes=float(num_layers * 12 * tokens * h * dtype_bytes),
        param_dtype_bytes=dtype_bytes,
        state_bytes_per_param_byte=8.0,
    )


MODEL_PROFILES: dict[str, Callable[..., ModelProfile]] = {
    "transformer": transformer,
    "tp-transformer": tp_transformer,
    "dlrm": dlrm,
    "moe": moe,
}
"""The built-in model profiles by the name ``commfuse simulate --workload`` gives them."""

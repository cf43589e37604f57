"""Decentralized averaging: the topologies as data, and gossip and PushSum on real gloo ranks
against their mixing matrices applied in plain torch (fp64), with the bytes of every round."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from commfuse.cluster import RankError
from commfuse.comm import Communicator, InconsistentInputError
from commfuse.decentral import (
    Explicit,
    Exponential,
    GossipAveraging,
    PushSum,
    Ring,
    ShiftOne,
    Topology,
    Torus,
    sgp_offsets,
)
from commfuse.decentral.topology import TOPOLOGIES
from commfuse.testing import RankPool

PoolFn = Callable[[int], RankPool]

#: Two tensors per rank (12 + 5 elements): the flat model spans parameters.
SHAPES = ((3, 4), (5,))
NUMEL = 17
ROUNDS = 6


def bagua_peer(rank: int, nranks: int, comm_step: int) -> int:
    """Bagua's ``shift_one`` peer, as its tests state it (``get_peer_rank``)."""
    if rank < nranks // 2:
        return ((comm_step + rank) % ((nranks + 1) // 2)) + (nranks // 2)
    return (rank - (nranks // 2) - comm_step) % (nranks // 2)


def topology(name: str, world: int) -> Topology:
    return irregular(world) if name == "irregular" else TOPOLOGIES[name](world)


def irregular(world: int) -> Explicit:
    """A directed time-varying graph whose W(t) is column- but not row-stochastic: in round t
    rank t mod n gives 1/n to everyone, every other rank keeps 1/2 and pushes 1/2 ahead."""
    matrices = []
    for t in range(world):
        w = torch.zeros(world, world, dtype=torch.float64)
        for i in range(world):
            if i == t:
                w[:, i] = 1.0 / world
            else:
                w[i, i] += 0.5
                w[(i + 1) % world, i] += 0.5
        matrices.append(w)
    return Explicit(matrices, directed=True)


def initial(world: int, how: str) -> torch.Tensor:
    """Every rank's starting model, stacked (world x NUMEL, fp64); the same on every rank."""
    if how == "eigen":  # along the ring's second eigenvector: the spread shrinks by |l2|
        return torch.outer(second_eigenvector(Ring(world)), torch.linspace(1, 2, NUMEL))
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(world, NUMEL, generator=gen, dtype=torch.float64)


def second_eigenvector(topo: Topology) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(topo.matrix(0))
    column: torch.Tensor = vectors[:, values.abs().argsort()[-2]]
    return column


def params_of(row: torch.Tensor) -> list[torch.Tensor]:
    a, b = row[:12].reshape(SHAPES[0]).clone(), row[12:].clone()
    return [torch.nn.Parameter(a), torch.nn.Parameter(b)]


# ---- rank functions (module level, so the pool's ranks can import them) -----------------------


def run_rounds(method: str, name: str, how: str, every: int) -> dict[str, Any]:
    """``ROUNDS * every`` steps of ``method`` on ``name``: each round's flat model (and weight),
    the stats, the state after half the rounds resumed into a fresh object."""
    comm = Communicator()
    topo = topology(name, comm.world_size)
    params = params_of(initial(comm.world_size, how)[comm.rank])
    cls = PushSum if method == "push_sum" else GossipAveraging
    gossip = cls(params, comm, topo, every=every)
    rounds, weights, mixed = [], [], []
    for step in range(ROUNDS * every):
        if step == ROUNDS * every // 2:  # resume from a checkpoint: a fresh object
            state = gossip.state_dict()
            gossip = cls(params, comm, topo, every=every)
            gossip.load_state_dict(state)
        mixed.append(gossip.step())
        if mixed[-1]:
            rounds.append(torch.cat([p.detach().reshape(-1) for p in params]))
            weights.append(float(gossip.weight) if isinstance(gossip, PushSum) else 1.0)
    devices = {str(p.device) for p in params}
    if isinstance(gossip, PushSum):
        devices.add(str(gossip.weight.device))
    return {
        "rounds": torch.stack(rounds),
        "weights": weights,
        "mixed": mixed,
        "stats": comm.stats.snapshot(),
        "devices": sorted(devices),
        "state": gossip.state_dict(),
    }


def converge(name: str, rounds: int) -> tuple[torch.Tensor, float]:
    """PushSum for ``rounds`` rounds: the de-biased model and the weight."""
    comm = Communicator()
    params = params_of(initial(comm.world_size, "random")[comm.rank])
    sgp = PushSum(params, comm, topology(name, comm.world_size))
    for _ in range(rounds):
        sgp.mix()
    return torch.cat([p.detach().reshape(-1) for p in params]), float(sgp.weight)


def mismatched(same_numel: bool) -> None:
    comm = Communicator()
    shape = (4 + comm.rank,) if not same_numel else ((6,) if comm.rank == 0 else (2, 3))
    GossipAveraging([torch.zeros(shape, dtype=torch.float64)], comm, Ring(comm.world_size))


def refusals() -> list[str]:
    comm = Communicator()
    p = [torch.zeros(3)]
    found = []
    makers: list[Callable[[], object]] = [
        lambda: GossipAveraging(p, comm, irregular(3)),
        lambda: GossipAveraging(p, comm, Ring(comm.world_size + 1)),
        lambda: GossipAveraging(p, comm, Ring(comm.world_size), every=0),
        lambda: GossipAveraging(
            [torch.zeros(2), torch.zeros(2, dtype=torch.float64)], comm, Ring(1)
        ),
        lambda: GossipAveraging([torch.zeros(2, dtype=torch.int64)], comm, Ring(1)),
    ]
    for make in makers:
        try:
            make()
        except ValueError as err:
            found.append(str(err))
    return found


# ---- the topologies, without processes ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("world", range(1, 10))
def test_mixing_matrices_are_stochastic_and_edges_read_them(name: str, world: int) -> None:
    topo = TOPOLOGIES[name](world)
    for t in range(2 * topo.period + 1):
        w = topo.matrix(t)
        ones = torch.ones(world, dtype=torch.float64)
        assert torch.allclose(w.sum(0), ones, atol=1e-15), (t, w)
        assert torch.equal(w, topo.matrix(t + topo.period))
        if not topo.directed:
            assert torch.equal(w, w.T) and torch.allclose(w.sum(1), ones, atol=1e-15)
        for i in range(world):
            edges = topo.edges(t, i)
            assert edges.keep == w[i, i]
            assert [(j, v) for j, v in edges.send] == [
                (j, float(w[j, i])) for j in range(world) if j != i and w[j, i] != 0
            ]
            assert [(j, v) for j, v in edges.recv] == [
                (j, float(w[i, j])) for j in range(world) if j != i and w[i, j] != 0
            ]


def test_ring_and_torus_weights_are_the_papers() -> None:
    ring = Ring(5).matrix(0)
    assert torch.allclose(ring[0], torch.tensor([1 / 3, 1 / 3, 0, 0, 1 / 3], dtype=torch.float64))
    assert torch.equal(Ring(2).matrix(0), torch.full((2, 2), 0.5, dtype=torch.float64))
    torus = Torus(9)
    assert (torus.rows, torus.cols) == (3, 3)
    assert sorted(j for j, _ in torus.edges(0, 4).send) == [1, 3, 5, 7]
    assert {w for _, w in torus.edges(0, 4).send} == {0.2} and torus.edges(0, 4).keep == 0.2
    assert (Torus(8).rows, Torus(7).rows, Torus(12, rows=2).cols) == (2, 1, 6)
    with pytest.raises(ValueError, match="rows dividing"):
        Torus(8, rows=3)


@pytest.mark.parametrize("world", range(2, 9))
def test_shift_one_peers_are_baguas_formula(world: int) -> None:
    """Even worlds: every rank's peer is Bagua's formula in every round. Odd worlds (Bagua
    refuses them): the formula on world + 1 ranks, the rank paired with the missing one idle."""
    topo = ShiftOne(world)
    virtual = world + world % 2
    for t in range(3 * virtual):
        for rank in range(world):
            expected = bagua_peer(rank, virtual, t)
            peer = topo.peer(t, rank)
            assert peer == (None if expected == world else expected), (world, t, rank)
            sent = [j for j, _ in topo.edges(t, rank).send]
            assert sent == ([] if peer is None else [peer])
        idle = [r for r in range(world) if topo.peer(t, r) is None]
        assert len(idle) == world % 2


def test_exponential_offsets_are_sgps_phone_book() -> None:
    assert [sgp_offsets(n) for n in (1, 2, 3, 4, 5, 8)] == [
        (),
        (1,),
        (1, 2),
        (1, 3, 2),
        (1, 4, 2, 3),
        (1, 7, 2, 6, 4),
    ]
    assert Exponential(8).edges(3, 5).send == ((3, 0.5),) and Exponential(8).edges(3, 5).recv == (
        (7, 0.5),
    )


def test_explicit_refuses_what_is_not_stochastic() -> None:
    ok = torch.full((2, 2), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="columns sum"):
        Explicit([ok * 2])
    with pytest.raises(ValueError, match="not symmetric"):
        Explicit([torch.tensor([[1.0, 0.5], [0.0, 0.5]])], directed=False)
    with pytest.raises(ValueError, match="negative"):
        Explicit([torch.tensor([[1.5, 0.5], [-0.5, 0.5]])])
    with pytest.raises(ValueError, match="at least one"):
        Explicit([])
    assert irregular(4).matrix(1).sum(1).tolist() != [1.0] * 4  # not row-stochastic


# ---- on gloo ranks -----------------------------------------------------------------------------


def reference(
    topo: Topology, x0: torch.Tensor, directed_weights: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each round's stacked models (de-biased for PushSum) and weights, in plain torch."""
    x, w = x0.clone(), torch.ones(x0.shape[0], 1, dtype=torch.float64)
    models, weights = [], []
    for t in range(ROUNDS):
        mix = topo.matrix(t)
        x, w = mix @ x, mix @ w
        models.append(x / w if directed_weights else x)
        weights.append(w.squeeze(1))
    return models, weights


def check_bytes(results: list[dict[str, Any]], topo: Topology, label: str, extra: int) -> None:
    for rank, result in enumerate(results):
        sends = [len(topo.edges(t, rank).send) for t in range(ROUNDS)]
        recvs = [len(topo.edges(t, rank).recv) for t in range(ROUNDS)]
        counters = result["stats"].get(
            label, {"bytes_sent": 0, "bytes_recv": 0, "messages_sent": 0}
        )
        assert counters["bytes_sent"] == sum(sends) * (NUMEL + extra) * 8, (rank, counters)
        assert counters["messages_sent"] == sum(sends)
        if sum(recvs):
            assert counters["bytes_recv"] == sum(recvs) * (NUMEL + extra) * 8
        assert set(result["stats"]) <= {label, "all_gather"}  # the one shape check besides


@pytest.mark.parametrize("world", [1, 3, 4, 5])
@pytest.mark.parametrize("name", ["ring", "torus", "shift_one", "exponential"])
def test_gossip_rounds_are_the_mixing_matrix_applied(pool: PoolFn, world: int, name: str) -> None:
    every = 2
    results = pool(world).run(run_rounds, "gossip", name, "random", every, timeout_s=120)
    topo = topology(name, world)
    expected, _ = reference(topo, initial(world, "random"), False)
    for t in range(ROUNDS):
        got = torch.stack([r["rounds"][t] for r in results])
        torch.testing.assert_close(got, expected[t], rtol=0, atol=1e-12)
        assert torch.allclose(got.mean(0), initial(world, "random").mean(0), atol=1e-12)
    for result in results:
        assert result["mixed"] == [s % every == every - 1 for s in range(ROUNDS * every)]
        assert result["state"] == {"steps": ROUNDS * every, "rounds": ROUNDS}
        assert result["devices"] == ["cpu"]
    check_bytes(results, topo, "gossip", 0)
    if name == "shift_one" and world % 2 == 0:  # one model per rank per round, exactly
        assert all(r["stats"]["gossip"]["bytes_sent"] == ROUNDS * NUMEL * 8 for r in results)


@pytest.mark.parametrize("world", [4, 5])  # on 3 ranks the ring is complete: lambda_2 = 0
def test_gossip_spread_shrinks_by_the_second_eigenvalue(pool: PoolFn, world: int) -> None:
    """Replicas along the ring's second eigenvector: each round multiplies their spread around
    the mean by |lambda_2| exactly, as W says (and the mean never moves)."""
    results = pool(world).run(run_rounds, "gossip", "ring", "eigen", 1, timeout_s=120)
    mix = Ring(world).matrix(0)
    values = torch.linalg.eigvalsh(mix)
    rate = float(values.abs().sort().values[-2])
    x = initial(world, "eigen")
    spread = float((x - x.mean(0)).norm())
    assert 0 < rate < 1 and spread > 0
    for t in range(ROUNDS):
        got = torch.stack([r["rounds"][t] for r in results])
        new = float((got - got.mean(0)).norm())
        assert abs(new / spread - rate) < 1e-12, (t, new / spread, rate)
        spread = new


@pytest.mark.parametrize("world", [1, 3, 4, 5])
@pytest.mark.parametrize("name", ["exponential", "irregular"])
def test_push_sum_rounds_and_weights_are_the_matrix_applied(
    pool: PoolFn, world: int, name: str
) -> None:
    results = pool(world).run(run_rounds, "push_sum", name, "random", 1, timeout_s=120)
    topo = topology(name, world)
    expected, weights = reference(topo, initial(world, "random"), True)
    moved = False
    for t in range(ROUNDS):
        got = torch.stack([r["rounds"][t] for r in results])
        torch.testing.assert_close(got, expected[t], rtol=1e-12, atol=1e-12)
        w = torch.tensor([r["weights"][t] for r in results], dtype=torch.float64)
        torch.testing.assert_close(w, weights[t], rtol=0, atol=1e-12)
        assert abs(float(w.sum()) - world) < 1e-12  # weights sum to n at every step
        moved |= bool((w - 1).abs().max() > 1e-3)
    assert moved == (name == "irregular" and world > 1)  # exponential: doubly stochastic, w = 1
    check_bytes(results, topo, "push_sum", 1)  # the weight rides in the model's message


@pytest.mark.parametrize("world", [3, 4, 5])
@pytest.mark.parametrize("name", ["exponential", "irregular"])
def test_push_sum_debiased_models_reach_the_average(pool: PoolFn, world: int, name: str) -> None:
    results = pool(world).run(converge, name, 60, timeout_s=120)
    average = initial(world, "random").mean(0)
    assert abs(sum(w for _, w in results) - world) < 1e-12
    for z, _ in results:
        torch.testing.assert_close(z, average, rtol=0, atol=1e-9)


def test_mismatched_models_are_named(pool: PoolFn) -> None:
    with pytest.raises(RankError) as info:
        pool(2).run(mismatched, False)
    assert isinstance(info.value.exc, InconsistentInputError)
    message = str(info.value.exc)
    assert "rank 0: 1 tensors, 4 torch.float64" in message and "rank 1: 1 tensors, 5" in message
    with pytest.raises(RankError) as info:
        pool(2).run(mismatched, True)
    assert "(other shapes)" in str(info.value.exc)


def test_bad_settings_are_refused(pool: PoolFn) -> None:
    (found,) = pool(1).run(refusals)
    assert len(found) == 5, found
    assert "use PushSum" in found[0] and "for 2 ranks" in found[1] and "every" in found[2]
    assert "one dtype" in found[3] and "floating-point" in found[4]


# ---- the strategies, through the training loop -------------------------------------------------


def train_on_rank(config: Any) -> dict[str, Any]:
    from commfuse.train import train_rank

    return train_rank(config)


def _train_config(strategy: str, steps: int, **kw: Any) -> Any:
    from commfuse.cli.spec import strategy_from_spec, workload_from_spec
    from commfuse.train import TrainConfig

    return TrainConfig(
        workload=workload_from_spec(DIGITS),
        strategy=strategy_from_spec(strategy),
        label=strategy,
        steps=steps,
        seed=1,
        **kw,
    )


DIGITS = "digits:hidden=32,batch=16"
#: digits:hidden=32 has (64*32+32) + (32*32+32) + (32*10+10) fp32 parameters.
DIGITS_MODEL_BYTES = 4 * ((64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10))


DIGITS_NUMEL = DIGITS_MODEL_BYTES // 4
#: int8's message of the model: one fp32 scale and a code per element, padded to words.
DIGITS_INT8_BYTES = -(-(4 + DIGITS_NUMEL) // 4) * 4


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("strategy", "per_round"),
    [
        ("gossip:topology=ring,every=2", 2 * DIGITS_MODEL_BYTES),
        ("push-sum:every=2", DIGITS_MODEL_BYTES + 4),
        ("gossip:topology=ring,every=2,compressor=int8,gamma=0.8", 2 * DIGITS_INT8_BYTES),
    ],
)
def test_decentral_strategies_train_count_their_bytes_and_resume_exactly(
    pool: PoolFn, tmp_path: Path, strategy: str, per_round: int
) -> None:
    """Three ranks through the training loop: the loss falls, every second step sends the
    topology's messages (the ring: two models per rank, or two int8 messages with CHOCO; the
    exponential graph: one model, with its weight), and a resume from step 3 of 7 (mid-period)
    ends bit for bit as the straight run."""
    from commfuse.train import checkpoint as ckpt

    p = pool(3)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    config = _train_config(strategy, 7, checkpoint_dir=str(full_dir), checkpoint_every=3)
    full = p.run(train_on_rank, config, timeout_s=120)
    assert full[0]["history"]["loss"][-1] < full[0]["history"]["loss"][0]
    for result in full:
        # The end's exact average, one all-reduce of the model, is charged to the last step.
        assert result["history"]["bytes"] == [0, per_round] * 3 + [DIGITS_MODEL_BYTES]
        assert result["strategy_metrics"]["gossip_rounds"] == 3
        assert result["strategy_metrics"]["final_sync_bytes"] == DIGITS_MODEL_BYTES
    shutil.copytree(ckpt.step_dir(full_dir, 3), ckpt.step_dir(resumed_dir, 3))
    ckpt.mark_latest(resumed_dir, 3)
    config = _train_config(strategy, 7, checkpoint_dir=str(resumed_dir), resume=True)
    resumed = p.run(train_on_rank, config, timeout_s=120)
    assert resumed[0]["start_step"] == 3
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]
    assert len({r["digest"] for r in full}) == 1  # the final average: one model


def test_decentral_specs_round_trip() -> None:
    from commfuse.cli.spec import strategy_from_spec
    from commfuse.compress import Int8
    from commfuse.decentral import GossipConfig, PushSumConfig
    from commfuse.train import describe_strategy

    for config in (
        GossipConfig(topology="torus", every=4),
        PushSumConfig(every=2, final_average=False),
        GossipConfig(topology="torus", compressor=Int8(), gamma=0.25),
        GossipConfig(),
    ):
        assert strategy_from_spec(describe_strategy(config)) == config
    assert describe_strategy(GossipConfig(topology="ring")) == "gossip:topology=ring"
    with pytest.raises(ValueError, match="topology"):
        strategy_from_spec("gossip:topology=star")
    with pytest.raises(ValueError, match="every"):
        strategy_from_spec("push-sum:every=0")
    with pytest.raises(ValueError, match="ring or torus"):
        strategy_from_spec("gossip:compressor=int8")
    with pytest.raises(ValueError, match="needs a compressor"):
        strategy_from_spec("gossip:gamma=0.3")
    with pytest.raises(ValueError, match="a message of its own"):
        strategy_from_spec("gossip:topology=ring,compressor=powersgd")


# ---- CHOCO-Gossip: compressed messages ---------------------------------------------------------


def choco_compressor(name: str) -> Any:
    from commfuse.compress import Int8, TopK

    return Int8() if name == "int8" else TopK(ratio=0.3)


def run_choco(name: str, gamma: float, rounds: int) -> dict[str, Any]:
    from commfuse.decentral import ChocoGossip

    comm = Communicator()
    params = params_of(initial(comm.world_size, "random")[comm.rank])
    compressor = choco_compressor(name)
    choco = ChocoGossip(params, comm, Ring(comm.world_size), compressor, gamma=gamma)
    models = []
    for t in range(rounds):
        if t == rounds // 2:  # resume from a checkpoint: a fresh object
            state = choco.state_dict()
            choco = ChocoGossip(params, comm, Ring(comm.world_size), compressor, gamma=gamma)
            choco.load_state_dict(state)
        choco.mix()
        models.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return {"rounds": torch.stack(models), "stats": comm.stats.snapshot()}


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_choco_rounds_are_the_papers_updates_and_keep_the_mean(pool: PoolFn, name: str) -> None:
    """Four ranks on a ring against CHOCO-Gossip in plain torch (fp64, 1e-12 per round): the
    public copies, the mixed copies and the consensus step; the mean never moves, the spread
    shrinks, and every rank sends its packed message to its two neighbours each round."""
    world, gamma, rounds = 4, 0.5, 40
    results = pool(world).run(run_choco, name, gamma, rounds, timeout_s=120)
    compressor = choco_compressor(name)
    mix = Ring(world).matrix(0)
    x = initial(world, "random")
    public = torch.zeros_like(x)
    mixed = torch.zeros_like(x)
    spread0 = float((x - x.mean(0)).norm())
    for t in range(rounds):
        q = torch.stack(
            [
                compressor.decompress(
                    compressor.compress(x[i] - public[i], step=t, rank=i), NUMEL, x.dtype, t
                )
                for i in range(world)
            ]
        )
        public, mixed = public + q, mixed + mix @ q
        x = x + gamma * (mixed - public)
        got = torch.stack([r["rounds"][t] for r in results])
        torch.testing.assert_close(got, x, rtol=0, atol=1e-12)
        assert torch.allclose(got.mean(0), initial(world, "random").mean(0), atol=1e-12)
    assert float((x - x.mean(0)).norm()) < 0.05 * spread0
    wire = compressor.layout(NUMEL, torch.float64, 0).wire_bytes
    assert wire < NUMEL * 8
    for result in results:
        assert result["stats"]["choco"]["bytes_sent"] == rounds * 2 * wire
        assert result["stats"]["choco"]["messages_sent"] == rounds * 2


def choco_refusals() -> list[str]:
    from commfuse.compress import FP16, Int8
    from commfuse.decentral import ChocoGossip

    comm = Communicator()
    p = [torch.zeros(3, dtype=torch.float64)]
    found = []
    makers: list[Callable[[], object]] = [
        lambda: ChocoGossip(p, comm, irregular(3), Int8(), gamma=0.5),
        lambda: ChocoGossip(p, comm, ShiftOne(3), Int8(), gamma=0.5),
        lambda: ChocoGossip(p, comm, Ring(1), FP16(), gamma=0.5),  # type: ignore[arg-type]
        lambda: ChocoGossip(p, comm, Ring(1), Int8(), gamma=0.0),
    ]
    for make in makers:
        try:
            make()
        except ValueError as err:
            found.append(str(err))
    return found


def test_choco_refuses_what_it_cannot_run(pool: PoolFn) -> None:
    (found,) = pool(1).run(choco_refusals)
    assert len(found) == 4, found
    assert "doubly stochastic" in found[0] and "use Ring or Torus" in found[1]
    assert "FP16 has none" in found[2] and "gamma" in found[3]

"""The simulator: closed forms on an idle network, link sharing, properties, bad input, CLI.

Pure Python and fast: no process group (the real-run validation is in test_sim_validate.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch

from commfuse.cli import main
from commfuse.collectives import cost as C
from commfuse.collectives.cost import PIPELINE_BLOCK_ALPHA_S
from commfuse.collectives.tuner import predict
from commfuse.sim import (
    ClusterModel,
    CommPlan,
    Demand,
    Layer,
    LayerComm,
    ModelProfile,
    Straggler,
    collective_time_s,
    demand,
    dlrm,
    from_module,
    simulate,
    simulate_step,
    transformer,
)
from commfuse.sim.network import Group, profile_of
from commfuse.sim.program import Task

FLAT = ClusterModel(num_hosts=8, ranks_per_host=1, inter_gbit_per_s=1.0, inter_latency_us=50.0)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("hosts", [2, 3, 8, 64])
@pytest.mark.parametrize("nbytes", [1, 4096, 1 << 24])
def test_idle_network_matches_closed_forms(hosts: int, nbytes: int) -> None:
    cluster = dataclasses.replace(FLAT, num_hosts=hosts)
    link = cluster.inter_cost()
    ring = collective_time_s("all_reduce", "ring", nbytes, cluster)
    assert _close(ring, C.ring_all_reduce(nbytes, hosts, link))
    f = (hosts - 1) / hosts
    by_hand = 2 * (hosts - 1) * link.alpha_s + 2 * f * nbytes * link.beta_s_per_byte
    assert _close(ring, by_hand + f * nbytes * link.gamma_s_per_byte)
    tree = collective_time_s("broadcast", "tree", nbytes, cluster)
    lg = math.ceil(math.log2(hosts))
    assert _close(tree, lg * (link.alpha_s + nbytes * link.beta_s_per_byte))
    lp = collective_time_s("broadcast", "lp", nbytes, cluster)
    # At the block collectives/pipeline.py cuts with no block size (0.5 ms per block, whole
    # fp32 elements); filling the chain pays alpha and beta per hop, then the per-block alpha
    # runs under the wire (sim/lp.py).
    code_link = C.LinkCost(alpha_s=PIPELINE_BLOCK_ALPHA_S, beta_s_per_byte=link.beta_s_per_byte)
    b = min(nbytes, max(1, C.lp_best_block_bytes(nbytes, hosts, code_link) // 4) * 4)
    steps = math.ceil(nbytes / b)
    by_hand = (hosts - 1) * link.alpha_s + (steps - 1) * max(
        0.0, link.alpha_s - b * link.beta_s_per_byte
    )
    assert _close(lp, by_hand + (nbytes + (hosts - 2) * b) * link.beta_s_per_byte)
    # The same numbers the tuner predicts with this cluster as its profile.
    profile = profile_of(cluster)
    for collective, algo in (
        ("all_reduce", "ring"),
        ("broadcast", "tree"),
        ("all_gather", "ring"),
        ("all_to_all", "pairwise"),
        ("all_reduce", "rabenseifner"),
    ):
        sim = collective_time_s(collective, algo, nbytes, cluster)
        assert _close(sim, predict(collective, algo, nbytes, hosts, profile))


def test_engine_runs_one_collective_in_its_closed_form_time() -> None:
    need = demand("all_reduce", "ring", 1 << 20, Group(size=8, ranks_per_host=1), FLAT)
    timeline = simulate(
        [Task(name="ar", stream="dp", category="dp", deps=[], demand=need)], world_size=8
    )
    assert _close(timeline.step_s, C.ring_all_reduce(1 << 20, 8, FLAT.inter_cost()))


def test_concurrent_flows_divide_the_link() -> None:
    """Two equal flows on one link take twice the bandwidth time; on different links, once."""
    one = Demand(latency_s=1e-3, busy_s={"nic": 10e-3})
    other = Demand(latency_s=1e-3, busy_s={"intra": 10e-3})
    shared = simulate(
        [
            Task(name="a", stream="dp", category="dp", deps=[], demand=one),
            Task(name="b", stream="mp", category="mp", deps=[], demand=one),
        ],
        world_size=2,
    )
    assert _close(shared.step_s, 1e-3 + 20e-3)
    apart = simulate(
        [
            Task(name="a", stream="dp", category="dp", deps=[], demand=one),
            Task(name="b", stream="mp", category="mp", deps=[], demand=other),
        ],
        world_size=2,
    )
    assert _close(apart.step_s, 11e-3)
    # Same stream: one after the other.
    serial = simulate(
        [
            Task(name="a", stream="dp", category="dp", deps=[], demand=one),
            Task(name="b", stream="dp", category="dp", deps=[0], demand=one),
        ],
        world_size=2,
    )
    assert _close(serial.step_s, 22e-3)


def test_all_reduce_never_beats_the_bandwidth_lower_bound() -> None:
    rng = random.Random(0)
    algos = ["ring", "native", "pipeline", "doubling", "rabenseifner", "auto"]
    for _ in range(300):
        hosts, local = rng.randint(2, 512), rng.choice([1, 1, 2, 8])
        cluster = ClusterModel(
            num_hosts=hosts,
            ranks_per_host=local,
            inter_gbit_per_s=rng.choice([1.0, 100.0, 400.0]),
            intra_gbyte_per_s=rng.choice([1.0, 450.0]),
        )
        n = rng.randint(1, 1 << 28)
        algo = rng.choice(algos + (["hierarchical"] if local > 1 else []))
        t = collective_time_s("all_reduce", algo, n, cluster)
        host_link = cluster.inter_gbit_per_s * 1e9 / 8
        # 2((P-1)/P) n / B over hosts: what must cross each host's link at the very least (with
        # one rank per host, the bound over ranks exactly).
        assert t >= C.all_reduce_lower_bound(n, hosts, host_link) * (1 - 1e-12), (
            hosts,
            local,
            algo,
        )


def _random_workload(rng: random.Random, comms: bool) -> ModelProfile:
    layers = []
    for i in range(rng.randint(1, 6)):
        extra: tuple[LayerComm, ...] = ()
        if comms and rng.random() < 0.5:
            extra = (
                LayerComm(
                    collective=rng.choice(["all_reduce", "all_to_all"]),
                    nbytes=rng.randint(1, 1 << 22),
                    group="world",
                    phase=rng.choice(["fwd", "bwd"]),
                ),
            )
        layers.append(
            Layer(
                name=f"l{i}",
                param_bytes=rng.randint(0, 1 << 24),
                fwd_flops=rng.uniform(0, 1e9),
                bwd_flops=rng.uniform(0, 2e9),
                comms=extra,
            )
        )
    return ModelProfile(name="random", layers=tuple(layers))


def test_adding_load_never_makes_a_step_faster() -> None:
    rng = random.Random(1)
    for trial in range(150):
        cluster = ClusterModel(
            num_hosts=rng.choice([2, 4, 16]),
            ranks_per_host=rng.choice([1, 2]),
            flops_per_s=1e10,
            memory_gbyte=100.0,
        )
        workload = _random_workload(rng, comms=True)
        strategy = CommPlan(
            bucket_cap_mb=0,
            overlap=rng.random() < 0.8,
            # Fixed algorithms: "auto" is the tuner's choice from its isolated model, which may
            # switch to an algorithm the shared-link engine finds faster at a larger size.
            algorithms=(("all_reduce", rng.choice(["rabenseifner", "ring", "native"])),),
            fused_chunks=rng.choice([1, 1, 4]),
        )
        base = simulate_step(cluster, workload, strategy).step_s
        more_compute = workload.scaled(flops=rng.uniform(1.0, 3.0))
        more_bytes = workload.scaled(nbytes=rng.uniform(1.0, 3.0))
        slower = dataclasses.replace(cluster, inter_gbit_per_s=cluster.inter_gbit_per_s / 2)
        for label, heavier in (
            ("flops", simulate_step(cluster, more_compute, strategy)),
            ("bytes", simulate_step(cluster, more_bytes, strategy)),
            ("link", simulate_step(slower, workload, strategy)),
        ):
            assert heavier.step_s >= base * (1 - 1e-9), (trial, label, heavier.step_s, base)


def test_a_straggler_slows_a_synchronous_step_by_at_least_its_delay() -> None:
    rng = random.Random(2)
    for _ in range(40):
        cluster = ClusterModel(num_hosts=4, ranks_per_host=2, flops_per_s=1e10, memory_gbyte=100.0)
        workload = _random_workload(rng, comms=False)
        base = simulate_step(cluster, workload).step_s
        delay_us = rng.uniform(1, 1e5)
        late = dataclasses.replace(
            cluster, stragglers=(Straggler(rank=rng.randrange(8), delay_us=delay_us),)
        )
        assert simulate_step(late, workload).step_s >= base + delay_us * 1e-6 * (1 - 1e-9)
        slow = Straggler(rank=3, slowdown=rng.uniform(1.5, 4))
        result = simulate_step(dataclasses.replace(cluster, stragglers=(slow,)), workload)
        assert (
            result.step_s >= result.compute_s >= workload.flops / 1e10 * slow.slowdown * (1 - 1e-9)
        )


def test_collectives_issued_match_the_strategy() -> None:
    """Count what is communicated: one allreduce per bucket, k chunks per fused collective."""
    layers = tuple(
        Layer(name=f"l{i}", param_bytes=(i + 1) << 20, fwd_flops=1e8, bwd_flops=2e8)
        for i in range(6)
    )
    workload = ModelProfile(name="mlp", layers=layers)
    cluster = ClusterModel(num_hosts=4)
    per_layer = simulate_step(cluster, workload, CommPlan(bucket_cap_mb=0))
    assert per_layer.num_collectives == 6
    buckets = [t for t in per_layer.timeline.tasks if t.category == "dp"]
    assert sum(t.nbytes for t in buckets) == workload.param_bytes
    # 6 MB, 5 MB | 4 MB, 3 MB | 2 MB, 1 MB with a 9 MB cap (backward order, flushed when full)
    assert simulate_step(cluster, workload, CommPlan(bucket_cap_mb=9)).num_collectives == 3
    half = simulate_step(cluster, workload, CommPlan(bucket_cap_mb=0, compression_ratio=0.5))
    agree = [t for t in half.timeline.tasks if t.name.startswith("agree finite")]
    # Each compressed bucket: an fp32 flag per tensor (weight, bias), then half its bytes.
    assert [t.nbytes for t in agree] == [4 * 2] * 6
    assert (
        sum(t.nbytes for t in half.timeline.tasks if t.category == "dp" and t not in agree)
        == workload.param_bytes // 2
    )
    no_agree = CommPlan(bucket_cap_mb=0, compression_ratio=0.5, finite_agreement=False)
    assert simulate_step(cluster, workload, no_agree).num_collectives == 6
    synced = simulate_step(cluster, workload, CommPlan(local_sgd_period=8))
    assert [t.category for t in synced.timeline.tasks if t.demand] == ["outer"]
    model = dlrm(world_size=4, num_tables=8, rows_per_table=1000, batch_per_rank=64)
    fused = simulate_step(cluster, model, CommPlan(fused_chunks=4, bucket_cap_mb=1000))
    a2a = [t for t in fused.timeline.tasks if t.category == "mp"]
    assert len(a2a) == 8 and sum(t.nbytes for t in a2a) == 2 * 64 * 8 * 128 * 4


def test_overlap_hides_communication_and_breakdown_adds_up() -> None:
    cluster = ClusterModel(num_hosts=16, ranks_per_host=1, flops_per_s=1e12, memory_gbyte=100)
    workload = transformer(num_layers=4, hidden=512, seq_len=256, batch_per_rank=2, vocab=1000)
    on = simulate_step(cluster, workload, CommPlan(bucket_cap_mb=1))
    off = simulate_step(cluster, workload, CommPlan(bucket_cap_mb=1, overlap=False))
    assert on.step_s < off.step_s
    assert off.overlapped_comm_s == pytest.approx(0.0, abs=1e-12)
    for r in (on, off):
        assert r.compute_s + r.exposed_comm_s == pytest.approx(r.step_s, rel=1e-9)


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="inter_gbit_per_s must be a positive"):
        ClusterModel(inter_gbit_per_s=-1.0)
    with pytest.raises(ValueError, match="unknown algorithm 'bogus' for all_reduce"):
        collective_time_s("all_reduce", "bogus", 1024, FLAT)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time_s("gossip", "ring", 1024, FLAT)
    with pytest.raises(ValueError, match="more than the cluster's 1 GB"):
        simulate_step(dataclasses.replace(FLAT, memory_gbyte=1.0), transformer())
    with pytest.raises(ValueError, match="unknown cluster keys"):
        ClusterModel.from_json('{"link_speed": 5}')
    with pytest.raises(ValueError, match="compression_ratio"):
        CommPlan(compression_ratio=0.0)


def test_cluster_json_round_trip() -> None:
    cluster = dataclasses.replace(
        FLAT, stragglers=(Straggler(rank=2, slowdown=1.5),), num_datacenters=2
    )
    assert ClusterModel.from_json(cluster.to_json()) == cluster


def test_workload_from_a_real_module_on_meta() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
    workload = from_module(model, (32, 64))
    assert [layer.name for layer in workload.layers] == ["0", "2"]
    assert workload.param_bytes == (64 * 128 + 128 + 128 * 10 + 10) * 4
    assert workload.layers[0].fwd_flops == 2 * 32 * 64 * 128
    # Backward of the first layer: only the weight gradient (its input needs none).
    assert workload.layers[0].bwd_flops == 2 * 32 * 64 * 128
    assert workload.layers[1].bwd_flops == 2 * 2 * 32 * 128 * 10


def test_cli_step_trace_and_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    assert main(["simulate", "--ranks", "64", "--trace", str(trace), "--straggler", "5:2"]) == 0
    out = capsys.readouterr().out
    assert "predicted step on 64 ranks" in out and "exposed communication" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 5}
    plot, records = tmp_path / "s.png", tmp_path / "s.json"
    assert (
        main(
            [
                "simulate",
                "--op",
                "broadcast",
                "--algo",
                "lp,tree",
                "--sizes",
                "64M",
                "--scale",
                "2:64",
                "--plot",
                str(plot),
                "--json",
                str(records),
            ]
        )
        == 0
    )
    rows = json.loads(records.read_text())
    tree = [r["step_us"] for r in rows if r["series"] == "tree"]
    assert tree == sorted(tree) and tree[-1] > 5 * tree[0]
    assert plot.stat().st_size > 1000
    assert main(["simulate", "--algo", "nope", "--ranks", "16"]) == 2
    assert "unknown algorithm 'nope'" in capsys.readouterr().err

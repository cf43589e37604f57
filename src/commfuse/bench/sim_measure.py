"""Real runs for calibration and validation: one runner per configuration, timed round-robin.

Every rank builds one runner per configuration (a closure holding its buffers, model and
optimizer), runs each once to warm it up (connections, allocator, autograd graphs), then runs
``reps`` rounds of *all* runners in turn. A burst of load from another job on the shared
machine then spoils one sample of many configurations instead of every sample of one (the same
reason ``collectives/calibration.py`` times round-robin; each round starts one configuration
later, so no configuration is always the first after a round's end). A sample is the slowest rank's time
(one all-reduce of max); the result is each configuration's median. Small messages take
``SMALL_MESSAGE_SAMPLES`` samples per round (their medians moved by up to 50% between runs).

Configurations are dicts (JSON-friendly, they go into the records):

* ``{"kind": "collective", "collective", "algo", "bytes"[, "block_bytes"][, "dtype"]}``
  (``dtype`` a torch dtype name, default ``float32``; ``bytes`` is the buffer's size);
* ``{"kind": "p2p", "bytes"}``: a ping-pong between rank 0 and the first rank of the next host,
  one-way time;
* ``{"kind": "compute", "model": spec}``: forward, backward and SGD step with no communication;
* ``{"kind": "memory", "bytes"}``: an SGD update ``p -= lr g`` (3 bytes moved per byte);
* ``{"kind": "reduce", "bytes"}``: ``a += b`` (gamma);
* ``{"kind": "cast", "bytes"}``: the fp16 compressor's local work (scale, cast, cast back);
* ``{"kind": "step", "engine": "torch-ddp" | "dataparallel" | "localsgd", "model": spec, ...}``:
  one training step (a local-SGD sample is a whole period of ``H`` steps, divided by H).

``spec`` is an MLP ``{"in": 784, "width": 1024, "depth": 3, "out": 10, "batch": 32}``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from commfuse.sim.calibrate import mlp

_Runner = Callable[[], float]

#: Messages up to this size take a few milliseconds, where one late wake-up of one of the
#: processes sharing the cores moves a sample by 50-100%: they get ``SMALL_MESSAGE_SAMPLES``
#: samples per round instead of one (cheap: about 10 ms each).
_SMALL_MESSAGE_BYTES = 512 * 1024
SMALL_MESSAGE_SAMPLES = 5


def samples_per_round(cfg: dict[str, Any]) -> int:
    """How many samples of ``cfg`` each round takes (see ``_SMALL_MESSAGE_BYTES``)."""
    small = cfg["kind"] in ("collective", "p2p") and cfg["bytes"] <= _SMALL_MESSAGE_BYTES
    return SMALL_MESSAGE_SAMPLES if small else 1


def _slowest(comm: Any, seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(t, "max")
    return float(t.item())


def _timed(
    comm: Any, body: Callable[[], None], *, divide: int = 1, refill_s: float = 0.0
) -> _Runner:
    """``body`` timed on every rank; the sample is the slowest rank's seconds / ``divide``.

    ``refill_s``: idle time before each sample, so that the host links' token buckets (netlab's
    tbf) are full when it starts, as the model assumes (``fit.with_burst``). Without it, a
    sample's burst credit depends on the previous configuration's traffic: allreduce 256 KB
    (the bucket's size) measured 2.9 to 12.6 ms for the same call in five runs."""

    def run() -> float:
        if refill_s > 0:
            time.sleep(refill_s)
        torch.distributed.barrier()
        began = time.perf_counter()
        body()
        return _slowest(comm, (time.perf_counter() - began) / divide)

    return run


def _collective(comm: Any, cfg: dict[str, Any], refill_s: float) -> _Runner:
    from commfuse import collectives as C

    dtype = getattr(torch, cfg.get("dtype", "float32"))
    n, world = cfg["bytes"] // dtype.itemsize, comm.world_size
    x = torch.ones(n, dtype=dtype)
    out = torch.empty(n, dtype=dtype)
    opts = {"block_bytes": cfg["block_bytes"]} if cfg.get("block_bytes") else {}
    algo, what = cfg["algo"], cfg["collective"]
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: C.all_reduce(comm, x, algo=algo, **opts),
        "broadcast": lambda: C.broadcast(comm, x, 0, algo=algo, **opts),
        "all_gather": lambda: C.all_gather(comm, out, x[: n // world], algo=algo),
        "all_to_all": lambda: C.all_to_all(comm, out, x, algo=algo),
    }
    if what not in calls:
        raise ValueError(f"cannot time collective {what!r}; known: {', '.join(calls)}")
    call = calls[what]

    def body() -> None:
        call()

    return _timed(comm, body, refill_s=refill_s)


def _p2p(comm: Any, cfg: dict[str, Any], ranks_per_host: int, refill_s: float) -> _Runner:
    buf = torch.zeros(max(1, cfg["bytes"] // 4))
    a, b = 0, ranks_per_host if comm.world_size > ranks_per_host else 1

    def body() -> None:
        if comm.rank == a:
            comm.send(buf, b, label="sim")
            comm.recv(buf, b, label="sim")
        elif comm.rank == b:
            comm.recv(buf, a, label="sim")
            comm.send(buf, a, label="sim")

    return _timed(comm, body, divide=2, refill_s=refill_s)


def _local(comm: Any, cfg: dict[str, Any]) -> _Runner:
    """Element-wise work every rank does at once (they share the cores, as in a step)."""
    from commfuse.compress.base import all_finite

    n = cfg["bytes"] // 4
    a, b = torch.ones(n), torch.ones(n)
    world = comm.world_size

    def memory() -> None:
        a.add_(b, alpha=-1e-3)

    def reduce() -> None:
        a.add_(b)

    def cast() -> None:
        # What DataParallel's fp16 path does locally per bucket: the finiteness test
        # (base.all_finite, one sum), CastCompressor's divide-and-cast, the copy back.
        all_finite(b)
        a.copy_((b / world).to(torch.float16))

    return _timed(comm, {"memory": memory, "reduce": reduce, "cast": cast}[cfg["kind"]])


def _step(comm: Any, cfg: dict[str, Any], refill_s: float) -> _Runner:
    spec = cfg["model"]
    torch.manual_seed(0)
    model = mlp(spec)
    x = torch.randn(spec["batch"], spec["in"])
    y = torch.randint(0, spec["out"], (spec["batch"],))
    engine = cfg.get("engine", "none")
    if engine == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"])
    elif engine == "dataparallel":
        from commfuse.compress import FP16
        from commfuse.ddp import DataParallel, DataParallelConfig

        # The compressors a step configuration may name (sim_validate.py's: fp16).
        compressors = {"fp16": FP16}
        compressor = cfg.get("compressor")
        config = DataParallelConfig(
            bucket_cap_mb=cfg["bucket_cap_mb"],
            algo=cfg["algo"],
            compressor=compressors[compressor](algo=cfg["algo"]) if compressor else None,
        )
        model = DataParallel(model, comm, config=config)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    if engine == "localsgd":
        from commfuse.localsgd import PeriodicSyncOptimizer, local_sgd

        period = int(cfg["H"])
        sync = local_sgd(H=period, algo=cfg["algo"])
        opt: Any = PeriodicSyncOptimizer(inner, model, comm, sync)
    else:
        period, opt = 1, inner

    def one() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        if engine == "dataparallel":
            model.step(opt)  # type: ignore[operator]
        else:
            opt.step()

    def body() -> None:  # local SGD: one whole period, so each sample holds one sync
        for _ in range(period):
            one()

    return _timed(comm, body, divide=period, refill_s=refill_s)


def measure_on_rank(
    configs: list[dict[str, Any]], reps: int, ranks_per_host: int = 1, refill_s: float = 0.0
) -> list[float]:
    """Run on every rank (``commfuse.cluster.run``): the median seconds of each configuration.
    ``refill_s``: idle seconds before each networked sample (``_timed``)."""
    from commfuse.comm import Communicator

    torch.set_num_threads(1)  # ranks share 2 cores; more threads would only fight over them
    comm = Communicator()
    runners: list[_Runner] = []
    for cfg in configs:
        kind = cfg["kind"]
        if kind == "collective":
            runners.append(_collective(comm, cfg, refill_s))
        elif kind == "p2p":
            runners.append(_p2p(comm, cfg, ranks_per_host, refill_s))
        elif kind in ("memory", "reduce", "cast"):
            runners.append(_local(comm, cfg))
        elif kind in ("compute", "step"):
            runners.append(_step(comm, cfg, refill_s if kind == "step" else 0.0))
        else:
            raise ValueError(f"unknown measurement kind {kind!r}")
    for runner in runners:  # warm-up, dropped
        runner()
    samples: list[list[float]] = [[] for _ in runners]
    for round_ in range(reps):
        # Each round starts one configuration later: whatever the first sample after the
        # previous round's last one pays (it was the noisiest of every run: allreduce 128 KB
        # first in calibration, 256 KB first in validation) falls on a different configuration
        # each round, where the median drops it.
        for k in range(len(runners)):
            i = (round_ + k) % len(runners)
            for _ in range(samples_per_round(configs[i])):
                samples[i].append(runners[i]())
    return [statistics.median(s) for s in samples]

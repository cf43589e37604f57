"""``commfuse bench``: benchmark commands, one module each (nccl-tests style tables, --json).

commfuse bench collectives --hosts 4 --link 1gbit --op all_reduce --sizes 16M --json out.json
commfuse bench fused --hosts 4 --link 1gbit --op gemm_all_reduce
commfuse bench ddp --hosts 4 --link 1gbit --model transformer
commfuse bench strategies --hosts 4 --link 100mbit --strategy ddp --strategy powersgd:rank=4
commfuse bench pipeline --hosts 4 --link 100mbit --micro-batches 8 --control
"""

from __future__ import annotations

import importlib

from commfuse.cli.common import Subparsers

#: Modules that each add one ``commfuse bench`` sub-command with ``register(bench_sub)``.
_BENCH_MODULES: tuple[str, ...] = (
    "commfuse.cli.bench.collectives",
    "commfuse.cli.bench.fused",
    "commfuse.cli.bench.ddp",
    "commfuse.cli.bench.strategies",
    "commfuse.cli.bench.pipeline",
)


def register(sub: Subparsers) -> None:
    """Add ``bench`` and its sub-commands to the ``commfuse`` command."""
    parser = sub.add_parser("bench", help="benchmarks (nccl-tests style tables, --json records)")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for module in _BENCH_MODULES:
        importlib.import_module(module).register(bench_sub)

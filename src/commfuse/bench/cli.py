"""``commfuse bench``: benchmark commands."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="benchmarks that print ratios against a baseline measured in the same run")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    del bench_sub

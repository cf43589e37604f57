"""A record of every communication operation, exportable as Chrome trace JSON.

Open the file in chrome://tracing or https://ui.perfetto.dev to see, per rank, when each send,
receive or collective was issued and when it completed. Completion is stamped by the backend's
future callback, not by the caller's ``wait()``, so overlap with computation shows truthfully.
Timestamps are wall-clock microseconds, so files written by ranks on one machine line up.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class TraceEvent:
    kind: str
    """Operation kind: send, recv, all_reduce, ... or an algorithm's label."""
    rank: int
    peer: int | None
    nbytes: int
    start_us: float
    end_us: float | None = None
    step: int | None = None
    group: str = "world"


def now_us() -> float:
    return time.time() * 1e6


class Trace:
    """Events of one rank, in issue order."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []

    def clear(self) -> None:
        self.events.clear()

    def chrome_events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in self.events:
            end = event.end_us if event.end_us is not None else event.start_us
            args: dict[str, Any] = {"bytes": event.nbytes, "group": event.group}
            if event.peer is not None:
                args["peer"] = event.peer
            if event.step is not None:
                args["step"] = event.step
            out.append(
                {
                    "name": event.kind,
                    "cat": "comm",
                    "ph": "X",
                    "ts": event.start_us,
                    "dur": max(0.0, end - event.start_us),
                    "pid": event.rank,
                    "tid": "comm" if event.peer is None else f"peer {event.peer}",
                    "args": args,
                }
            )
        return out

    def export_chrome(self, path: str | Path) -> None:
        write_chrome_trace(self.chrome_events(), path)


def write_chrome_trace(events: list[dict[str, Any]], path: str | Path) -> None:
    ranks = sorted({int(e["pid"]) for e in events})
    meta = [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks
    ]
    Path(path).write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))


def merge_chrome_traces(paths: Iterable[str | Path], out: str | Path) -> None:
    """One timeline from the per-rank files (each rank exports its own)."""
    events: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        events.extend(e for e in data["traceEvents"] if e.get("ph") != "M")
    write_chrome_trace(events, out)

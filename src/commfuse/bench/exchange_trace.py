"""Reading DreamDDP's exchange trace (``dreamddp:trace=1``, a run record's ``exchange_trace``).

Every rank keeps, per exchange it landed, when it launched it, when its communication thread
put it on the wire and took it off, when the layer's use asked for it and when the wait
returned (``DreamDDPOptimizer.trace``), on one clock shared by the ranks of a machine. An
allreduce ends only once the last rank has launched it, so the time an iteration's exchanges
take is counted here from the last rank's launch to the last rank's end: what the plan's
``comm_s`` predicts (``planned_iterations``), the ranks' skew apart.

    record = json.load(open("a.json"))[1]
    for row in iteration_timeline(record):
        print(row["iteration"], row["messages"], row["measured_s"], row["planned_s"])
"""

from __future__ import annotations

import statistics
from typing import Any

#: Messages below this many bytes are latency-bound on any link here (``message_wire_s``).
_SMALL_BYTES = 10_000


def _by_step(rank_trace: dict[str, Any]) -> dict[int, list[dict[str, float]]]:
    steps: dict[int, list[dict[str, float]]] = {}
    for exchange in rank_trace["exchanges"]:
        steps.setdefault(int(exchange["step"]), []).append(exchange)
    return steps


def iteration_timeline(record: dict[str, Any], *, profile_steps: int = 1) -> list[dict[str, Any]]:
    """Per iteration of the period that exchanged anything: ``iteration``, ``layers``,
    ``messages`` (one per distinct time on the wire), ``measured_s`` (the median over the
    run's periods of the last rank's launch to the last rank's end), ``planned_s`` (the
    plan's exchange time) and ``waited_s`` (the median over periods of the most any rank's
    uses waited for that iteration's exchanges in all).

    Raises:
        ValueError: the record has no trace (run without ``trace=1``).
    """
    traces = record.get("exchange_trace")
    if not traces:
        raise ValueError(f"{record.get('strategy')}: no exchange_trace (run with trace=1)")
    period = int(record["period_steps"])
    planned = record.get("planned_iterations") or []
    ranks = [(float(t["origin_s"]), _by_step(t)) for t in traces]
    steps = sorted({step for _, by_step in ranks for step in by_step})
    rows: dict[int, dict[str, Any]] = {}
    for step in steps:
        iteration = (step - 1 - profile_steps) % period
        launches, ends, waits = [], [], []
        layers: set[int] = set()
        messages = 0
        for origin, by_step in ranks:
            exchanges = by_step.get(step, [])
            if not exchanges:
                continue
            launches.append(origin + min(e["launched"] for e in exchanges))
            ends.append(origin + max(e["wire_end"] for e in exchanges))
            waits.append(sum(e["landed"] - e["used"] for e in exchanges))
            layers.update(int(e["layer"]) for e in exchanges)
            messages = len({e["wire_start"] for e in exchanges})
        if len(launches) < len(ranks):  # a rank landed none of it (the run's end)
            continue
        row = rows.setdefault(
            iteration, {"iteration": iteration, "layers": layers, "measured": [], "waits": []}
        )
        row["messages"] = messages
        row["measured"].append(max(ends) - max(launches))
        row["waits"].append(max(waits))
    return [
        {
            "iteration": it,
            "layers": sorted(row["layers"]),
            "messages": row["messages"],
            "measured_s": statistics.median(row["measured"]),
            "planned_s": planned[it]["comm_s"] if it < len(planned) else None,
            "waited_s": statistics.median(row["waits"]),
        }
        for it, row in sorted(rows.items())
    ]


def message_wire_s(record: dict[str, Any]) -> dict[str, float | None]:
    """Medians over every rank and step of a message's time on the wire: ``first`` (a step's
    first message, which waits for the last rank to launch), ``later_small`` and
    ``later_large`` (the others, below and above ``_SMALL_BYTES``, which start once the
    previous message ends); None where there is none."""
    first: list[float] = []
    small: list[float] = []
    large: list[float] = []
    for trace in record.get("exchange_trace") or []:
        for exchanges in _by_step(trace).values():
            messages: dict[float, list[dict[str, float]]] = {}
            for e in exchanges:
                messages.setdefault(e["wire_start"], []).append(e)
            for k, (start, parts) in enumerate(sorted(messages.items())):
                wire = parts[0]["wire_end"] - start
                size = sum(e["bytes"] for e in parts)
                (first if k == 0 else small if size < _SMALL_BYTES else large).append(wire)
    return {
        name: statistics.median(values) if values else None
        for name, values in (("first", first), ("later_small", small), ("later_large", large))
    }


def forward_skew_s(record: dict[str, Any], *, profile_steps: int = 1) -> list[float]:
    """Per iteration of the period, the median over the run's periods of the ranks' skew as
    that iteration's forward starts (the last rank's start less the first's)."""
    traces = record.get("exchange_trace") or []
    period = int(record["period_steps"])
    starts = [[float(t["origin_s"]) + s for s in t["forward_s"]] for t in traces]
    if not starts:
        return []
    skews: dict[int, list[float]] = {}
    for k in range(profile_steps, min(len(s) for s in starts)):  # forward k: step k + 1
        at = [s[k] for s in starts]
        skews.setdefault((k - profile_steps) % period, []).append(max(at) - min(at))
    return [statistics.median(skews[it]) for it in sorted(skews)]

"""Where two runs meant to be bit-identical part: the first step and parameter whose bits
differ, the first loss that differs, and what each run chose.

A training run's bits must follow from its seed, data and configuration alone. When two runs
that should agree (a run and its resume, a run on torchft and the same run without it) end
with different digests, the final digest says only that they differ. ``parting`` says where:

1. each run's record carries, per step, a hash of each parameter's bits
   (``TrainConfig.param_fingerprints``) and its loss; the first step whose hashes differ,
   and the parameters that differ there, locate the update that diverged (the loss of a
   step reads the parameters of the step before, so the first differing loss follows it);
2. a fault-tolerant run's record also has each committed step's quorum: a step committed by
   fewer replica groups than the run has averaged other gradients, however fault-free the run
   was meant to be (a replica stalled past ``timeout_s`` on a loaded machine);
3. each run's choices (``Strategy.choices``: bucket layout, algorithms, the compressor's
   settings and layouts) are shown side by side, their differences first.

``RunBits.of_plain(record)`` and ``RunBits.of_ft(record)`` read the two kinds of record.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunBits:
    """What one run's record says about its bits."""

    name: str
    digest: str
    """The final parameters' SHA-256."""
    losses: dict[int, float]
    """step -> loss (rank 0's, or replica group 0's)."""
    fingerprints: dict[int, dict[str, str]]
    """step -> parameter -> hash of its bits after the step (empty: not recorded)."""
    choices: Any
    """What the run chose (``Strategy.choices``)."""
    quorums: dict[int, int] | None = None
    """Fault-tolerant runs: committed step -> replica groups in its quorum."""
    num_replicas: int | None = None
    """Fault-tolerant runs: replica groups the run started with."""

    @classmethod
    def of_plain(cls, record: dict[str, Any], *, name: str = "plain", rank: int = 0) -> RunBits:
        """From ``run_training``'s record (rank ``rank``'s view)."""
        fingerprints = record.get("param_fingerprints") or [{}]
        start = int(record.get("start_step", 0))
        losses = record.get("rank_losses") or [[]]
        return cls(
            name=name,
            digest=str(record.get("digest", "")),
            losses={start + i: loss for i, loss in enumerate(losses[rank])},
            fingerprints={int(s): f for s, f in fingerprints[rank].items()},
            choices=(record.get("choices") or [None])[rank],
        )

    @classmethod
    def of_ft(cls, record: dict[str, Any], *, name: str = "ft", replica: int = 0) -> RunBits:
        """From ``run_fault_tolerant``'s record (replica group ``replica``'s committed steps,
        its last life's where it had several). Per-period mode's attempts are periods: each
        one's fingerprints and quorum are those of its last inner step, its losses those of
        the inner steps it trained (the steps of a run without torchft)."""
        mine = sorted(
            (r for r in record["records"] if r["replica"] == replica and r["committed"]),
            key=lambda r: (r["step"], r["life"]),
        )
        by_step = {_last_step(r): r for r in mine}
        quorums = {
            _last_step(r): r["participants"] for r in record["records"] if r["committed"]
        }  # every replica's commit of a step had the same quorum
        choices = [c for c in record.get("choices", []) if c.get("replica") == replica]
        losses: dict[int, float] = {}
        for s, r in by_step.items():
            if "inner_steps" not in r:
                losses[s] = r["loss"]
                continue
            first = r["first_step"] + r.get("skipped_steps", 0)
            losses.update({first + i: loss for i, loss in enumerate(r["losses"])})
        return cls(
            name=name,
            digest=str(record.get("digest", "")),
            losses=losses,
            fingerprints={
                s: r["fingerprints"] for s, r in by_step.items() if r.get("fingerprints")
            },
            choices=choices[-1] if choices else None,
            quorums=quorums,
            num_replicas=len(record.get("per_replica", [])) or None,
        )


def _last_step(attempt: dict[str, Any]) -> int:
    """The run's step an attempt ends at: its step, or a period's last inner step."""
    if "inner_steps" in attempt:
        return int(attempt["first_step"] + attempt["inner_steps"] - 1)
    return int(attempt["step"])


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two plain-data values differ, as ``path: a != b`` lines (keys of one only too)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                out.append(f"{where}: only in {'the second' if key not in a else 'the first'}")
            else:
                out += _differences(a[key], b[key], where)
        return out
    if a != b:
        return [f"{path or 'value'}: {_short(a)} != {_short(b)}"]
    return []


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parting(a: RunBits, b: RunBits) -> str | None:
    """Where ``a`` and ``b`` part (see the module docstring); None when their digests agree.

    Returns:
        A report of several lines: the digests, the first step and parameters whose bits
        differ, the first differing loss, quorums smaller than the run's replica groups, and
        the choices (their differences, then each run's in full, shortened).
    """
    if a.digest == b.digest:
        return None
    lines = [f"{a.name} and {b.name} part: final digests {a.digest[:12]} != {b.digest[:12]}"]
    common = sorted(set(a.fingerprints) & set(b.fingerprints))
    first = next((s for s in common if a.fingerprints[s] != b.fingerprints[s]), None)
    if first is not None:
        names = [
            n
            for n in a.fingerprints[first]
            if a.fingerprints[first][n] != b.fingerprints[first].get(n)
        ]
        lines.append(
            f"first step whose parameters differ: {first} ({len(names)} of "
            f"{len(a.fingerprints[first])}: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
            + (f"; steps {common[0]}-{first - 1} agree" if first > common[0] else "")
        )
    elif common:
        lines.append(f"every fingerprinted step agrees ({common[0]}-{common[-1]})")
    else:
        lines.append("no step fingerprinted in both (TrainConfig.param_fingerprints)")
    steps = sorted(set(a.losses) & set(b.losses))
    loss_step = next((s for s in steps if a.losses[s] != b.losses[s]), None)
    if loss_step is not None:
        lines.append(
            f"first loss that differs: step {loss_step} ({a.losses[loss_step]!r} != "
            f"{b.losses[loss_step]!r})"
        )
    for run in (a, b):
        if run.quorums is not None and run.num_replicas is not None:
            short = {s: n for s, n in sorted(run.quorums.items()) if n < run.num_replicas}
            if short:
                lines.append(
                    f"{run.name}: steps committed by fewer than its {run.num_replicas} replica "
                    f"groups (step: quorum): {short}: a replica was left out (stalled past "
                    "timeout_s, or not yet heard by the lighthouse); the others averaged "
                    "other gradients"
                )
    differences = _differences(a.choices, b.choices)
    if differences:
        lines.append("choices that differ: " + "; ".join(differences[:10]))
    lines.append(f"{a.name} chose: {_short(a.choices, 600)}")
    lines.append(f"{b.name} chose: {_short(b.choices, 600)}")
    return "\n".join(lines)

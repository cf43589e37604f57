"""Pipeline schedules as data: actions in torch.distributed.pipelining's grammar, and CSV files.

A schedule says, for each rank, what it does at each step. An action is written as torch writes
it (``torch/distributed/pipelining/schedules.py``, ``_Action``): the stage index, the kind, the
micro-batch index, with nothing between them.

1. Compute: ``0F1`` (stage 0, forward of micro-batch 1), ``1B2`` (full backward), ``0I3``
   (backward for the input gradient only) and ``0W3`` (backward for the weight gradient only,
   after ``0I3``: the split of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).
2. Communication, added by the lowering (``lower.py``): ``2SEND_F1`` (stage 2 sends its output
   of micro-batch 1), ``3RECV_F1`` (stage 3 receives its input of micro-batch 1), ``SEND_B`` and
   ``RECV_B`` the same for gradients.
3. torch's memory actions without a micro-batch (``1UNSHARD``, ``1RESHARD``, ``1REDUCE_GRAD``)
   are read and written so its files load; commfuse's passes treat them as no-ops.

A CSV file holds one row per rank and one cell per step, an empty cell where the rank is idle:
the format of torch's ``_dump_csv``/``_load_csv``, so a schedule written here loads there.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, cast

ActionKind = Literal[
    "F", "I", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"
]
#: The kinds that compute (torch's ``is_compute_op`` without its overlapped pair).
COMPUTE_KINDS: frozenset[str] = frozenset({"F", "I", "B", "W"})
#: The kinds the lowering adds.
COMM_KINDS: frozenset[str] = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
#: torch's memory actions, carried through unchanged.
MEMORY_KINDS: frozenset[str] = frozenset({"UNSHARD", "RESHARD", "REDUCE_GRAD"})

# Longest kinds first, so that ``SEND_F`` is not read as ``S``.
_ACTION = re.compile(
    r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)(\d*)$"
)


@dataclasses.dataclass(frozen=True)
class Action:
    """One action of one rank: ``Action(0, "F", 1)`` is written ``0F1``."""

    stage: int
    """The stage the action belongs to (for a receive: the stage that receives)."""
    kind: ActionKind
    """What it does (the module docstring lists the kinds)."""
    microbatch: int | None = None
    """The micro-batch; None only for torch's memory actions."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @staticmethod
    def parse(text: str) -> Action:
        """``"2SEND_F1"`` -> ``Action(2, "SEND_F", 1)``.

        Raises:
            ValueError: the text is not an action, or a compute or communication action has no
                micro-batch.
        """
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(
                f"bad action {text!r}: write stage, kind, micro-batch, like 0F1, 1B2, 0I3, 0W3, "
                "2SEND_F1 or 1RECV_B0 (kinds: F I B W SEND_F RECV_F SEND_B RECV_B)"
            )
        stage, kind, microbatch = match.groups()
        if not microbatch and kind not in MEMORY_KINDS:
            raise ValueError(f"bad action {text!r}: a {kind} action needs a micro-batch index")
        return Action(int(stage), cast(ActionKind, kind), int(microbatch) if microbatch else None)


#: One rank's list of actions, one per step; None where the rank is idle.
RankActions = tuple["Action | None", ...]


def parse_row(cells: Iterable[str]) -> RankActions:
    """One rank's cells (``["0F0", "", "0B0"]``) as actions, an empty cell as None."""
    return tuple(Action.parse(c) if c.strip() else None for c in cells)


def format_rows(actions: Sequence[Sequence[Action | None]]) -> list[list[str]]:
    """The cells of each rank's row, as torch's ``_dump_csv`` writes them."""
    return [["" if a is None else str(a) for a in row] for row in actions]


def write_csv(actions: Sequence[Sequence[Action | None]], path: str | Path) -> None:
    """Write one row per rank (torch's ``_dump_csv`` format)."""
    with open(path, "w", newline="") as file:
        csv.writer(file).writerows(format_rows(actions))


def read_csv(path: str | Path) -> tuple[RankActions, ...]:
    """Read one row per rank (torch's ``_dump_csv`` format): the actions of each rank.

    Raises:
        ValueError: a cell that is not an action (the message names row and column).
    """
    rows: list[RankActions] = []
    with open(path, newline="") as file:
        for rank, cells in enumerate(csv.reader(file)):
            try:
                rows.append(parse_row(cells))
            except ValueError as err:
                raise ValueError(f"{path}: rank {rank} (row {rank + 1}): {err}") from None
    return tuple(rows)

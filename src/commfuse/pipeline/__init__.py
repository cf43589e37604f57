"""Floor 3: pipeline parallelism, with its schedules as data.

| module | what it holds |
|---|---|
| ``actions.py`` | an action (``0F1``, ``1I2``, ``0W3``, ``2SEND_F1``) and torch's CSV format |
| ``schedule.py`` | ``Schedule``: per rank, one action per step; what each action needs |
| ``generators.py`` | GPipe, 1F1B, interleaved 1F1B, ZB-H1, and sequential (no pipelining) |
| ``validate.py`` | the validator |
| ``lower.py`` | the lowering that adds the sends and receives |
| ``replay.py`` | the replay on the alpha-beta link model: step time, bubble |
| ``runtime.py`` | ``PipelineRuntime``: a rank's share of a lowered schedule over ``comm`` |
| ``boundary.py`` | ``Boundary``: fp16, bf16, int8, AQ-SGD delta and subspace stage boundaries |
| ``cut.py`` | cutting a model into stages, balanced from a per-layer profile |

The guide, with each schedule's bubble and paper: ``docs/pipeline.md``.
"""

from commfuse.pipeline.actions import Action, read_csv, write_csv
from commfuse.pipeline.boundary import Boundary
from commfuse.pipeline.cut import LayerProfile, balanced_boundaries, cut, profile_layers
from commfuse.pipeline.generators import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_by_name,
    sequential,
    zb_h1,
)
from commfuse.pipeline.lower import lower
from commfuse.pipeline.replay import ReplayResult, StageTimes, bubble_of_events, on_grid, replay
from commfuse.pipeline.runtime import PipelineError, PipelineRuntime, StepResult
from commfuse.pipeline.schedule import (
    Schedule,
    ScheduleError,
    schedule_from_actions,
    schedule_from_csv,
)
from commfuse.pipeline.validate import validate

__all__ = [
    "Action",
    "Boundary",
    "LayerProfile",
    "PipelineError",
    "PipelineRuntime",
    "ReplayResult",
    "Schedule",
    "ScheduleError",
    "StageTimes",
    "StepResult",
    "balanced_boundaries",
    "bubble_of_events",
    "cut",
    "gpipe",
    "interleaved_1f1b",
    "lower",
    "on_grid",
    "one_f_one_b",
    "profile_layers",
    "read_csv",
    "replay",
    "schedule_by_name",
    "schedule_from_actions",
    "schedule_from_csv",
    "sequential",
    "validate",
    "write_csv",
    "zb_h1",
]

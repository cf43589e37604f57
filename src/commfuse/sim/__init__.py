"""The simulator: predict a training step's time on clusters far larger than this machine, from
the cost models the tuner uses (``collectives/cost.py``), calibrated and checked against real
runs (``commfuse simulate --validate``, whose real runs live in ``bench``). Nothing here needs
a process group.

The model is arithmetic and imports no torch (``from_module`` imports it when called, to read a
real module); its names load on first use (``commfuse.lazy``), so ``commfuse simulate --help``
does not pay for the event engine's numpy either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from commfuse.lazy import attach

if TYPE_CHECKING:
    from commfuse.sim.bound import GlobalWait, StepBound, StepGraph, step_bound
    from commfuse.sim.builtins import MODEL_PROFILES, dlrm, moe, tp_transformer, transformer
    from commfuse.sim.cluster import PRESETS, ClusterModel, Straggler, load_cluster
    from commfuse.sim.engine import Timeline, simulate
    from commfuse.sim.model import Layer, LayerComm, ModelProfile, from_module
    from commfuse.sim.network import Demand, Group, collective_time_s, demand
    from commfuse.sim.plan import CommPlan
    from commfuse.sim.program import build_step
    from commfuse.sim.step import StepResult, chrome_trace, simulate_step

__all__ = [
    "MODEL_PROFILES",
    "PRESETS",
    "ClusterModel",
    "CommPlan",
    "Demand",
    "GlobalWait",
    "Group",
    "Layer",
    "LayerComm",
    "ModelProfile",
    "StepBound",
    "StepGraph",
    "StepResult",
    "Straggler",
    "Timeline",
    "build_step",
    "chrome_trace",
    "collective_time_s",
    "demand",
    "dlrm",
    "from_module",
    "load_cluster",
    "moe",
    "simulate",
    "simulate_step",
    "step_bound",
    "tp_transformer",
    "transformer",
]

#: Each public name under the module that defines it, imported when the name is first read.
__getattr__, __dir__ = attach(
    __name__,
    {
        "MODEL_PROFILES": "commfuse.sim.builtins",
        "dlrm": "commfuse.sim.builtins",
        "moe": "commfuse.sim.builtins",
        "tp_transformer": "commfuse.sim.builtins",
        "transformer": "commfuse.sim.builtins",
        "GlobalWait": "commfuse.sim.bound",
        "StepBound": "commfuse.sim.bound",
        "StepGraph": "commfuse.sim.bound",
        "step_bound": "commfuse.sim.bound",
        "PRESETS": "commfuse.sim.cluster",
        "ClusterModel": "commfuse.sim.cluster",
        "Straggler": "commfuse.sim.cluster",
        "load_cluster": "commfuse.sim.cluster",
        "Timeline": "commfuse.sim.engine",
        "simulate": "commfuse.sim.engine",
        "Layer": "commfuse.sim.model",
        "LayerComm": "commfuse.sim.model",
        "ModelProfile": "commfuse.sim.model",
        "from_module": "commfuse.sim.model",
        "Demand": "commfuse.sim.network",
        "Group": "commfuse.sim.network",
        "collective_time_s": "commfuse.sim.network",
        "demand": "commfuse.sim.network",
        "CommPlan": "commfuse.sim.plan",
        "build_step": "commfuse.sim.program",
        "StepResult": "commfuse.sim.step",
        "chrome_trace": "commfuse.sim.step",
        "simulate_step": "commfuse.sim.step",
    },
)

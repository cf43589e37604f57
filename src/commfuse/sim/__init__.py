"""The simulator: predict a training step's time on clusters far larger than this machine, from
the cost models the tuner uses (``collectives/cost.py``), calibrated and checked against real
runs (``commfuse simulate --validate``). Nothing here needs a process group except ``validate``.
"""

from commfuse.sim.builtins import WORKLOADS, dlrm, moe, tp_transformer, transformer
from commfuse.sim.cluster import PRESETS, ClusterModel, Straggler, load_cluster
from commfuse.sim.engine import Timeline, simulate
from commfuse.sim.model import Layer, LayerComm, ModelProfile, from_module
from commfuse.sim.network import Demand, Group, collective_time_s, demand
from commfuse.sim.plan import CommPlan
from commfuse.sim.program import build_step
from commfuse.sim.step import StepResult, chrome_trace, simulate_step

__all__ = [
    "PRESETS",
    "WORKLOADS",
    "ClusterModel",
    "CommPlan",
    "Demand",
    "Group",
    "Layer",
    "LayerComm",
    "ModelProfile",
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
    "tp_transformer",
    "transformer",
]

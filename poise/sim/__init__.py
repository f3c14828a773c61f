"""The simulator: the real EngineCore + Scheduler + KVCacheManager in virtual time.

Stdlib only. Cost models (``cost``, ``roofline``, ``fit``) say how long a step takes; the
client arrival model (``arrival``) says when a sent request reaches the engine;
``SimExecutor`` advances a ``VirtualClock`` by the step time instead of running a model;
``simulate_cell`` drives closed- or open-loop workloads through it (``driver``, ``cell``).
See docs/simulator.md.
"""

from __future__ import annotations

from poise.sim.accelerators import ACCELERATORS, Accelerator, get_accelerator
from poise.sim.arrival import ArrivalModel
from poise.sim.cost import CostModel, FixedCostModel, LinearCostModel, StepShape
from poise.sim.executor import DecisionRecorder, SimExecutor, StepDecision
from poise.sim.fit import fit_step_costs, load_profile
from poise.sim.roofline import RooflineCostModel
from poise.sim.shapes import ModelShape, load_shape
from poise.sim.simulator import (
    SimCell,
    SimRequest,
    SimRequestResult,
    SimResult,
    SimStep,
    drive,
    simulate_cell,
)
from poise.sim.tokens import PromptLengths, to_sim_requests

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "ArrivalModel",
    "CostModel",
    "DecisionRecorder",
    "FixedCostModel",
    "LinearCostModel",
    "ModelShape",
    "PromptLengths",
    "RooflineCostModel",
    "SimCell",
    "SimExecutor",
    "SimRequest",
    "SimRequestResult",
    "SimResult",
    "SimStep",
    "StepDecision",
    "StepShape",
    "drive",
    "fit_step_costs",
    "get_accelerator",
    "load_profile",
    "load_shape",
    "simulate_cell",
    "to_sim_requests",
]

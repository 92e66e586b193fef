"""partita: plan and train PyTorch models too large for one device.

capture -> cost -> plan -> runtime; see DESIGN.md in the project's shared folder.
"""

from partita.capture import capture
from partita.cost.cluster import Cluster
from partita.errors import (
    CaptureError,
    InfeasiblePlanError,
    InputError,
    ModelSpecError,
    NumericsError,
    PartitaError,
    PlanFileError,
)
from partita.plan.simulate import SimResult, simulate
from partita.planner import plan
from partita.types import CostTable, GraphInput, OpGraph, OpNode, ParamInfo, Plan, Schedule, StagePlan, TensorInfo

__version__ = "0.1.0"


def __getattr__(name: str):
    # The runtime imports torch.distributed: load it on first use, so that planning stays light.
    if name == "Trainer":
        from partita.runtime.trainer import Trainer

        return Trainer
    if name == "load_into_model":
        from partita.runtime.checkpoint import load_into_model

        return load_into_model
    raise AttributeError(f"module 'partita' has no attribute {name!r}")


__all__ = [
    "CaptureError",
    "Cluster",
    "CostTable",
    "InfeasiblePlanError",
    "Plan",
    "PlanFileError",
    "Schedule",
    "SimResult",
    "StagePlan",
    "plan",
    "simulate",
    "GraphInput",
    "InputError",
    "ModelSpecError",
    "NumericsError",
    "OpGraph",
    "OpNode",
    "ParamInfo",
    "PartitaError",
    "TensorInfo",
    "Trainer",
    "capture",
    "load_into_model",
]

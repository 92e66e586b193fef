"""partita: plan and train PyTorch models too large for one device.

capture -> cost -> planning -> runtime; see the README's Layout section.

Every public name is loaded on first use (PEP 562), so that ``import partita.capturing`` pulls in
only the capture layer and what it needs (tests/unit/test_layering.py checks every layer).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "capture": "partita.capturing",
    "Cluster": "partita.types",
    "CostSource": "partita.planning.options",
    "PlanOptions": "partita.planning.options",
    "plan": "partita.planning.api",
    "simulate": "partita.planning.simulate",
    "Trainer": "partita.runtime.trainer",
    "load_into_model": "partita.runtime.checkpoint",
    **{
        name: "partita.errors"
        for name in (
            "CaptureError",
            "CollectiveTimeoutError",
            "InfeasiblePlanError",
            "InputError",
            "ModelSpecError",
            "NumericsError",
            "PartitaError",
            "PlanFileError",
        )
    },
    **{
        name: "partita.types"
        for name in (
            "CostTable",
            "GraphInput",
            "OpGraph",
            "OpNode",
            "OptimizerKind",
            "ParamInfo",
            "Plan",
            "Precision",
            "Schedule",
            "Sharding",
            "SimResult",
            "StagePlan",
            "TensorInfo",
        )
    },
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'partita' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

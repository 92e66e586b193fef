"""partita: plan and train PyTorch models too large for one device.

The public API is what ``__all__`` lists: the verbs and the objects a user holds. ::

    graph = partita.capture(model, kwargs=batch)                      # optional: plan takes the model too
    plan = partita.plan(model, kwargs=batch, cluster=partita.Cluster(device="h100", num_devices=8),
                        global_batch_size=64, options=partita.PlanOptions(precision="bf16"))
    trainer = partita.Trainer(model, plan, kwargs=batch, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    partita.fit(trainer, loader, num_steps=1000)                      # or trainer.step(**batch) in a loop

The records these return and take (stages, costs, graph nodes, enums such as ``Schedule``) live
in ``partita.types``; the layers (capture -> cost -> planning -> runtime) in their packages.

Every public name is loaded on first use (PEP 562), so that ``import partita.capturing`` pulls in
only the capture layer and what it needs (tests/unit/test_layering.py checks every layer).
"""

from __future__ import annotations

import importlib
import warnings

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    # capture -> plan
    "capture": "partita.capturing",
    "Cluster": "partita.types",
    "DeviceGroup": "partita.types",
    "PlanOptions": "partita.planning.options",
    "plan": "partita.runtime.job",
    "shared_plan": "partita.runtime.job",
    "plan_with_baselines": "partita.planning.api",
    "manual_plan": "partita.planning.manual",
    "simulate": "partita.planning.simulate",
    "Plan": "partita.types",
    "OpGraph": "partita.types",
    # train
    "Trainer": "partita.runtime.trainer",
    "fit": "partita.training.fit",
    "FitResult": "partita.training.fit",
    "save_seed": "partita.runtime.materialize",
    "load_into_model": "partita.runtime.checkpoint",
    # errors
    **{
        name: "partita.errors"
        for name in (
            "CaptureError",
            "CollectiveTimeoutError",
            "CompileError",
            "InfeasiblePlanError",
            "InputError",
            "NumericsError",
            "PartitaError",
            "PlanFileError",
            "RendezvousTimeoutError",
        )
    },
}

# Names the top level exported before its API was made intentional: still found, with a
# DeprecationWarning naming where they live now.
_MOVED = {
    "CostSource": "partita.planning.options",
    "ModelSpecError": "partita.errors",
    **{
        name: "partita.types"
        for name in (
            "CostTable",
            "GraphInput",
            "OpNode",
            "OptimizerKind",
            "ParamInfo",
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
    if name in _MOVED:
        warnings.warn(
            f"partita.{name} moved: import it from {_MOVED[name]} (from {_MOVED[name]} import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'partita' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

"""Frozen data shared by every layer of partita: the one layer everybody imports.

``graph``      OpGraph and its parts (nodes, tensors, parameters, inputs): what capture produces.
``choices``    Schedule, OptimizerKind, Precision, Sharding, Accumulation and Recompute.
``costs``      CostTable: per-node costs at one micro-batch size, the planner's view of cost/.
``devices``    DeviceSpec and the device catalog (``get_device``, device files).
``cluster``    Cluster (and DeviceGroup): how many devices of which kinds, in which nodes, linked how.
``plan``       StagePlan, MemoryBreakdown and Plan; ``plan_file`` reads and writes them as versioned JSON.
``sim``        SimResult and TimelineEvent: a simulated step, which report/ draws.
``schedule_orders``  each rank group's action order under each schedule (torch's), which the
             planner simulates and the runtime runs; ``whole_batch``: the check that a loss
             coupling the samples of a batch gets it whole.

Glossary
--------
node        one operation of the captured training computation (an FX ``call_function`` node),
            identified by its position ``index`` in topological order.
parameter   a parameter or buffer of the model, named by its *canonical* fully-qualified name:
            the first name ``model.named_parameters()`` / ``named_buffers()`` gives it. Tied
            parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are one
            parameter with several ``aliases``.
batch dim   the dimension of a tensor that scales with the batch size. Shapes are recorded at
            the example batch size (``OpGraph.batch_size``); costs at another micro-batch size
            scale the batch-proportional parts.
"""

from partita.types.choices import (
    RECOMPUTE_LEVELS,
    Accumulation,
    OptimizerKind,
    Precision,
    Recompute,
    Schedule,
    Sharding,
)
from partita.types.cluster import Cluster, DeviceGroup
from partita.types.costs import CostTable
from partita.types.devices import DeviceSpec
from partita.types.graph import Block, GraphInput, LossFn, OpGraph, OpNode, ParamInfo, TensorInfo
from partita.types.plan import PLAN_SCHEMA_VERSION, MemoryBreakdown, Plan, StagePlan
from partita.types.sim import SimResult, TimelineEvent

__all__ = [
    "Accumulation",
    "PLAN_SCHEMA_VERSION",
    "RECOMPUTE_LEVELS",
    "Block",
    "Cluster",
    "CostTable",
    "DeviceGroup",
    "DeviceSpec",
    "GraphInput",
    "LossFn",
    "MemoryBreakdown",
    "OpGraph",
    "OpNode",
    "OptimizerKind",
    "ParamInfo",
    "Plan",
    "Precision",
    "Recompute",
    "Schedule",
    "Sharding",
    "SimResult",
    "StagePlan",
    "TensorInfo",
    "TimelineEvent",
]

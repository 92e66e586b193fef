"""Sharded data parallelism per stage: torch's FSDP2 (``fully_shard``) inside each replica group.

A stage the plan shards (``StagePlan.sharding``) over its ``r`` replicas runs as an FSDP2 module
on the DeviceMesh of its replica group (the ``dp`` axis of the pp x dp mesh; in an uneven plan,
a mesh over the stage's own ranks), applied to the stage's runner -- the module that
torch.distributed.pipelining's PipelineStage (or partita's uneven executor) drives, which defers
the reduce-scatter of gradients to the last micro-batch of the step (``whole`` accumulation), or
reduce-scatters them in every micro-batch's backward and sums them into the shards (``sharded``,
``StagePlan.accumulation``), and re-gathers as the level says:

- ``shard_grads_and_optimizer``: ``reshard_after_forward=False`` (ZeRO-2-like): parameters stay
  gathered from a micro-batch's forward to its backward; gradients are reduce-scattered and
  optimizer state is kept for this rank's shard only;
- ``full_shard``: ``reshard_after_forward=True`` (ZeRO-3): parameters are re-gathered for every
  forward and every backward.

The parameters of a sharded stage become DTensors (a ``1/r`` shard each, along dim 0); this
rank's optimizer is built over them. Gradients are reduce-scattered as SUMS (divide factor 1)
so that ``GradientSync`` scales every gradient once, sharded or not, and clips by the norm over
all shards. Exactness is that of replicated training (fp32, up to summation order).

Graphs captured at other shapes (runtime/variants.py: batches padded to a shorter length) train
on sharded stages too, exactly: their stages hold the planned stages' containers, and a variant's
step runs them through the same FSDP2 modules (``standing_in``), so FSDP2 gathers the parameters
for their forwards and reduce-scatters the gradients of their backwards as for the planned graph.
``evaluate`` gathers the parameters whole (``unshard``) for the eval graph's forwards, then
reshards them.

Refused with InputError, before training: a parameter read by a sharded stage and by another
stage (tied weights across stages: their gradients would have to be summed shard by shard
across pipeline positions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from partita.errors import InputError
from partita.runtime.pipeline import StageRunner
from partita.runtime.precision import Compute
from partita.runtime.process_groups import Topology, new_group
from partita.runtime.segments import block_containers
from partita.runtime.stage_modes import sharded_stages
from partita.runtime.stages import StageModule
from partita.types import OpGraph, Plan, Sharding

__all__ = [
    "check_sharding",
    "gathered",
    "replica_mesh",
    "shard_runner",
    "sharded_names",
    "sharded_runners",
    "standing_in",
]


def check_sharding(plan: Plan, stages: Sequence[StageModule]) -> None:
    """InputError for what sharded stages cannot run exactly (see the module docstring)."""
    sharded = sharded_stages(plan)
    if not sharded:
        return
    readers: dict[str, set[int]] = {}
    for stage in stages:
        for name in stage.spec.param_names:
            readers.setdefault(name, set()).add(stage.spec.index)
    for name, indices in sorted(readers.items()):
        if len(indices) > 1 and indices & sharded:
            raise InputError(
                f"{name!r} is read by stages {sorted(indices)} (tied weights), and stage(s) "
                f"{sorted(indices & sharded)} of them are sharded: partita does not shard a parameter that "
                "several stages share; plan with sharding='replicate' for those stages, or cut so that one "
                "stage reads it"
            )


def sharded_names(plan: Plan, stages: Sequence[StageModule]) -> set[str]:
    """Canonical names of the parameters and buffers read by sharded stages (the whole plan's)."""
    sharded = sharded_stages(plan)
    return {name for s in stages if s.spec.index in sharded for name in s.spec.param_names}


def sharded_runners(
    plan: Plan, stages: Sequence[StageModule], topology: Topology, compute: Compute, graph: OpGraph
) -> dict[int, nn.Module]:
    """Stage index -> the FSDP2 module running it, for this rank's sharded ``stages``: each whole
    block of the stage its own FSDP2 unit (``partita.runtime.segments.block_containers``), the rest
    of the stage the root's, as torchtitan shards a model (a block's weights gathered for its
    forward and backward alone, the next block's prefetched). Collective (the replica meshes):
    call it on every rank."""
    runners: dict[int, nn.Module] = {}
    if not sharded_stages(plan):
        return runners
    mesh = replica_mesh(plan, topology)
    for stage in stages:
        stage_plan = plan.stages[stage.spec.index]
        if stage_plan.sharding is Sharding.REPLICATE or stage_plan.num_replicas == 1:
            continue
        units = [shard_runner(c, stage_plan.sharding, mesh, compute) for c in block_containers(stage, graph).values()]
        for before, unit, after in zip([None, *units], units, [*units[1:], None]):
            unit.set_modules_to_forward_prefetch([after] if after is not None else [])
            unit.set_modules_to_backward_prefetch([before] if before is not None else [])
        runner = StageRunner.of(stage, plan, compute)
        runners[stage.spec.index] = shard_runner(runner, stage_plan.sharding, mesh, compute)
    return runners


@contextlib.contextmanager
def gathered(runners: Mapping[int, nn.Module]) -> Iterator[None]:
    """For an evaluation, or a run of the stages outside their runners: the sharded parameters
    gathered whole (FSDP2's ``unshard`` of every unit, the root first; registered in the
    containers that the eval graph's stages hold too), resharded afterwards."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for runner in runners.values() for m in runner.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


@contextlib.contextmanager
def standing_in(runners: Mapping[int, nn.Module], stages: Sequence[StageModule]) -> Iterator[None]:
    """The FSDP2 ``runners`` run ``stages`` (of the same indices) in place of their own stages:
    a variant's stages, which hold the planned stages' containers (``StageModule.hold_tensors_of``),
    so FSDP2 gathers their parameters and reduce-scatters their gradients as for the planned ones."""
    by_index = {stage.spec.index: stage for stage in stages}
    for index, runner in runners.items():
        stage = by_index[index]
        runner.__dict__["stand_in"] = None if stage is runner.stage else stage  # not a submodule: see StageRunner
    try:
        yield
    finally:
        for runner in runners.values():
            runner.__dict__["stand_in"] = None


def replica_mesh(plan: Plan, topology: Topology) -> Any:
    """The DeviceMesh of this rank's replica group, for FSDP2. Uniform plans: the ``dp`` axis of the
    pp x dp mesh. Uneven plans (``plan`` the job's, every stage at its own tensor-parallel degree
    ``t``): every rank creates a process group per sharded stage and index ``i < t`` (the stage's
    ranks ``[i::t]``), in stage order (torch.distributed requires all ranks to), and this rank's
    makes a 1-D mesh of its ranks. Collective: call it on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    if topology.uniform:
        return topology.mesh["dp"]
    mine = None
    for index in sorted(sharded_stages(plan)):
        stage = plan.stages[index]
        t = stage.tensor_parallel
        for i in range(t):
            ranks = list(stage.ranks[i::t])
            group = new_group(ranks, topology.timeout)
            if topology.rank in ranks:
                mine = DeviceMesh.from_group(group, topology.device.type, mesh=ranks)
    return mine


def shard_runner(runner: nn.Module, sharding: Sharding, mesh: Any, compute: Compute) -> nn.Module:
    """``fully_shard`` the stage runner (or a block unit of it) over ``mesh`` (its replica group),
    gradients summed, in the compute precision's policy (precision.py)."""
    from torch.distributed.fsdp import fully_shard

    module = fully_shard(
        runner,
        mesh=mesh,
        reshard_after_forward=sharding is Sharding.FULL_SHARD,
        mp_policy=compute.fsdp_policy(),
    )
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return module

"""How each stage of a plan runs its backward, read off the plan: which stages FSDP2 shards, which
fully, which reduce-scatter their gradients in every backward, and which run their whole backward
at once under a split-backward schedule. The pipeline (``partita.runtime.pipeline``), the sharding
(``partita.runtime.sharding``) and the step program read them here."""

from __future__ import annotations

from partita.types import Accumulation, Plan, Recompute, Schedule, Sharding

__all__ = ["full_shard_stages", "sharded_accumulation_stages", "sharded_stages", "whole_backward_stages"]


def sharded_stages(plan: Plan) -> set[int]:
    """Indices of the stages that FSDP2 shards (a sharding level other than replicate)."""
    return {s.index for s in plan.stages if s.sharding is not Sharding.REPLICATE}


def full_shard_stages(plan: Plan) -> set[int]:
    """Indices of the stages FSDP2 shards fully (ZeRO-3: weights gathered for each forward and backward)."""
    return {s.index for s in plan.stages if s.sharding is Sharding.FULL_SHARD and s.num_replicas > 1}


def sharded_accumulation_stages(plan: Plan) -> set[int]:
    """Sharded stages that reduce-scatter their gradients in every backward (``Accumulation.SHARDED``)."""
    return {s.index for s in plan.stages if s.accumulation is Accumulation.SHARDED and s.index in sharded_stages(plan)}


def whole_backward_stages(plan: Plan) -> set[int]:
    """Stages that run their whole backward at once under a split-backward schedule (ZBV), giving up
    ZBV's split: the fully sharded ones, and those recomputed selectively.

    FSDP2 with ``reshard_after_forward`` frees a stage's gathered parameters after every forward,
    and ZBV runs a micro-batch's weight-gradient pass after later forwards of the stage: those
    gradients came out wrong (tests/dist/test_batch_shapes.py's sweep). torch's selective
    checkpoint allows one backward through its region, and the weight pass would be a second
    ("Trying to backward an extra time"). Computed in the input-gradient pass with the rest, both
    are exact. (The planner recomputes nothing under ZBV; a manual plan may.)"""
    if plan.schedule is not Schedule.ZBV:
        return set()
    return {
        s.index
        for s in plan.stages
        if (s.sharding is Sharding.FULL_SHARD and s.num_replicas > 1) or s.recompute is Recompute.SELECTIVE
    }

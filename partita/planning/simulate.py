"""Simulate a Plan: turn its stages and cost tables into the simulator's inputs and run it.

``partita.planning.simulator`` simulates a schedule over per-stage seconds and bytes; this module
makes those of a Plan (``pipeline_inputs``) or of stages not yet built into one
(``stages_pipeline_inputs``: the refinement's splits), from each stage's node range in its cost
table, its recomputation level, sharding, ranks and the cluster's links.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from partita.cost import comm
from partita.cost.analytic import optimizer_step_s
from partita.cost.memory import kept_per_microbatch
from partita.cost.partial_recompute import partial_segment_totals, recomputed_seconds
from partita.cost.recompute import extra_backward_s
from partita.cost.segment_memory import segment_totals
from partita.errors import InputError
from partita.planning.build import BuildMemo
from partita.planning.sharding import ShardedExposure, collective_times_s
from partita.planning.simulator import PipelineInputs, simulate_pipeline
from partita.types import (
    Accumulation,
    CostTable,
    OptimizerKind,
    Plan,
    Precision,
    Recompute,
    Schedule,
    Sharding,
    SimResult,
)
from partita.types.cluster import Cluster
from partita.types.schedule_orders import stage_rank_groups

__all__ = ["SimResult", "pipeline_inputs", "simulate", "simulate_plan"]

Costs = Callable[[int], CostTable] | CostTable  # cost tables per micro-batch size, or one table


class SimulatedStage(Protocol):
    """What the simulator's inputs read of a stage: a StagePlan, or a split the refinement has not
    built into a Plan (``partita.planning.split_steps``)."""

    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def recompute(self) -> Recompute: ...
    @property
    def sharding(self) -> Sharding: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def num_replicas(self) -> int: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def accumulation(self) -> Accumulation: ...
    @property
    def recompute_blocks(self) -> int | None: ...


def simulate(
    plan: Plan,
    costs: Callable[[int], CostTable] | CostTable,
    cluster: Cluster | Mapping[str, Any] | None = None,
    *,
    keep_timeline: bool = True,
) -> SimResult:
    """Simulate one training step of ``plan``; ``cluster`` defaults to the plan's own.

    ``costs(microbatch_size)`` returns the CostTable at that per-replica micro-batch size (a bare
    CostTable serves when every stage runs at its micro-batch size), in the plan's precision
    (``analytic_costs(..., precision=plan.precision)``) and for its tensor-parallel degree (one
    device's costs of a group: its share of the work and the group's all-reduces, which are part
    of every forward and backward; ``partita.cost.tensor_parallel``); InputError otherwise.
    """
    result = simulate_plan(plan, costs, cluster, keep_timeline=keep_timeline)
    assert result is not None  # no step to beat: simulated to the end
    return result


def simulate_plan(
    plan: Plan,
    costs: Costs,
    cluster: Cluster | Mapping[str, Any] | None = None,
    *,
    keep_timeline: bool = True,
    memo: BuildMemo | None = None,
    step_to_beat: float | None = None,
) -> SimResult | None:
    """``simulate`` for the planner: ``memo`` holds per-range sums shared with the run's other
    plans (``PlanningContext.build_memo``); with ``step_to_beat``, None as soon as the step surely
    exceeds it (``simulate_pipeline``)."""
    return simulate_pipeline(
        **pipeline_inputs(plan, costs, cluster, memo=memo), keep_timeline=keep_timeline, step_to_beat=step_to_beat
    )


def pipeline_inputs(
    plan: Plan,
    costs: Costs,
    cluster: Cluster | Mapping[str, Any] | None = None,
    *,
    memo: BuildMemo | None = None,
) -> PipelineInputs:
    """The keyword arguments of simulate_pipeline for ``plan``.

    Per stage: forward/backward seconds are sums over its node range (recomputation adds what its
    level runs again to the backward, ``partita.cost.recompute``); activations kept per micro-batch
    are the range's saved tensors, or what its recomputation level keeps (full: only the stage
    input, ``cut_bytes[start]``; selective: also the kept outputs); the all-reduce (sharded: reduce-scatter)
    moves the trainable parameter bytes of the range over the stage's replicas (one ring per
    tensor-parallel index, side by side, each over a device's shard), a sharded stage's
    all-gather their bytes in the plan's precision (``_collectives``); the send to the next stage moves
    ``cut_bytes[stop]`` (``whole_cut_bytes`` to a stage of another tensor-parallel degree) between the
    two stages' first ranks; the optimizer step moves the range's
    trainable parameters (a sharded stage: its shard) and states over the device's memory
    bandwidth (``optimizer_step_s``, slowed by ``cluster.compute_slowdown`` like the compute).
    """
    cluster = _as_cluster(plan, cluster)
    groups = stage_rank_groups(plan.schedule, plan.num_rank_groups, plan.num_stages)
    for stage, group in zip(plan.stages, groups):
        if stage.rank_group != group:
            raise InputError(
                f"stage {stage.index} is on rank group {stage.rank_group}, but {plan.schedule.value} "
                f"places it on rank group {group}: rebuild the plan with that placement"
            )
    tables = _tables_per_stage(plan, costs)
    optimizer = plan.options.get("optimizer", "adam")
    return stages_pipeline_inputs(
        plan.stages, tables, groups, plan.schedule, plan.num_microbatches, plan.precision, optimizer, cluster, memo
    )


def stages_pipeline_inputs(
    stages: Sequence[SimulatedStage],
    tables: Sequence[CostTable],
    groups: Sequence[int],
    schedule: Schedule,
    num_microbatches: int,
    precision: Precision,
    optimizer: OptimizerKind | str,
    cluster: Cluster,
    memo: BuildMemo | None = None,
) -> PipelineInputs:
    """``pipeline_inputs`` from the stages alone (``SimulatedStage``: the refinement simulates
    splits without building their Plans, ``partita.planning.split_steps``), each stage's CostTable,
    its rank group, and the plan's schedule, micro-batches, precision and optimizer."""
    fwd, bwd, wgt, split, act, allreduce, tail, gather, opt = [], [], [], [], [], [], [], [], []
    for stage, table in zip(stages, tables):
        if memo is None:
            inputs = _stage_inputs(stage, table, precision, optimizer, cluster, None)
        else:  # the plans of one run share most stages: the same seconds again (memo: one per cluster)
            key = ("stage inputs", stage.start, stage.stop, stage.recompute, stage.sharding, stage.ranks, id(cluster))
            key += (stage.tensor_parallel, stage.accumulation, stage.recompute_blocks, precision, optimizer)
            inputs = memo.get(table, key, _stage_inputs, stage, table, precision, optimizer, cluster, memo)
        for values, value in zip((fwd, bwd, wgt, split, act, allreduce, tail, gather, opt), inputs):
            values.append(value)
    send = []
    for k in range(len(stages) - 1):
        here, after = stages[k], stages[k + 1]
        if groups[k] == groups[k + 1]:
            send.append(0.0)
            continue
        same_node = cluster.rank_to_node(here.ranks[0]) == cluster.rank_to_node(after.ranks[0])
        alike = here.tensor_parallel == after.tensor_parallel  # else whole tensors (CostTable.whole_cut_bytes)
        sent = tables[k].cut_bytes if alike else tables[k].whole_cut_bytes
        send.append(comm.p2p_time_s(float(sent[here.stop]), cluster, same_node=same_node))
    return PipelineInputs(
        schedule=schedule,
        num_microbatches=num_microbatches,
        num_rank_groups=len(set(groups)),
        forward_s=fwd,
        backward_s=bwd,
        backward_weight_s=wgt,
        split_backward_s=split,
        send_s=send,
        allreduce_s=allreduce,
        activation_bytes=act,
        optimizer_s=opt,
        allreduce_tail_s=tail,
        gather_s=gather,
    )


def _stage_inputs(
    stage: SimulatedStage,
    table: CostTable,
    precision: Precision,
    optimizer: OptimizerKind | str,
    cluster: Cluster,
    memo: BuildMemo | None,
) -> tuple[float, float, float, float, int, float, float, float, float]:
    """(forward, backward, backward-weight, what splitting the backward adds to its input pass,
    activation bytes, gradient collective, its tail, all-gather, optimizer step) of one stage, as
    ``pipeline_inputs`` describes them."""
    a, b = stage.start, stage.stop
    if memo is None:
        forward, backward, weight, split, kept, trainable, selective, saved = _range_sums(table, a, b)
    else:
        sums = memo.get(table, ("sums", a, b), _range_sums, table, a, b)
        forward, backward, weight, split, kept, trainable, selective, saved = sums
    if stage.recompute_blocks is not None:  # only the first blocks recompute (partial_recompute)
        backward = backward + float(
            extra_backward_s(stage.recompute, *recomputed_seconds(table, a, b, stage.recompute_blocks))
        )
    else:
        backward = backward + float(extra_backward_s(stage.recompute, forward, selective))
    reduce_s, tail_s, gather_s = collectives = _collectives(stage, trainable, precision, cluster)
    if stage.sharding is not Sharding.REPLICATE and stage.num_replicas > 1:  # by block: what shows (sharding.py)
        segments = segment_totals(table, a, b, trainable)
        times = dict(num_replicas=stage.num_replicas, precision=precision, cluster=cluster)
        times["spans_nodes"] = comm.spans_nodes(stage.ranks, cluster)
        shown = ShardedExposure.of(stage.sharding, gather_s, reduce_s, segments, **times)
        if bool(shown.by_block):  # unit by unit as each block's backward ends: the root's last
            collectives = (reduce_s, float(shown.root_reduce_s), gather_s)
        if stage.sharding is Sharding.FULL_SHARD:
            forward = forward + float(shown.gather_shown(forward))
            backward = backward + float(shown.gather_shown(backward))
        if stage.accumulation is Accumulation.SHARDED:  # every backward ends with its reduce-scatter
            backward = backward + float(shown.reduce_shown(backward))
            collectives = (0.0, 0.0, gather_s)
    shards = stage.num_replicas if stage.sharding is not Sharding.REPLICATE else 1
    step_s = cluster.compute_slowdown * optimizer_step_s(
        trainable / shards, optimizer, cluster.device, precision=precision
    )
    stage_input = int(table.cut_bytes[a])
    if stage.recompute_blocks is not None and stage.recompute is not Recompute.NONE:
        stage_input = partial_segment_totals(
            table, a, b, trainable, stage.recompute, stage.recompute_blocks
        ).kept_inputs
    kept = int(kept_per_microbatch(stage.recompute, kept, stage_input, saved))
    return (forward, backward, weight, split, kept, *collectives, step_s)


def _range_sums(table: CostTable, start: int, stop: int) -> tuple[float, float, float, float, int, int, float, int]:
    """(forward, backward, backward_weight, split_backward seconds, activation bytes kept, trainable
    parameter bytes, selectively recomputed seconds, bytes selective recomputation keeps) of nodes
    [start, stop)."""
    held = np.asarray(table.params_in_range(start, stop), dtype=np.int64)
    held = held[np.asarray(table.param_trainable, dtype=bool)[held]]
    return (
        float(table.forward_s[start:stop].sum()),
        float(table.backward_s[start:stop].sum()),
        float(table.backward_weight_s[start:stop].sum()),
        float(table.split_backward_s[start:stop].sum()),
        int(table.activation_bytes[start:stop].sum()),
        int(np.asarray(table.param_bytes, dtype=np.int64)[held].sum()),
        float(table.selective_recompute_s[start:stop].sum()),
        int(table.saved_bytes[start:stop].sum()),
    )


def _collectives(
    stage: SimulatedStage, trainable_bytes: int, precision: Precision, cluster: Cluster
) -> tuple[float, float, float]:
    """(gradient collective, its part that cannot overlap the last backward, start-of-step
    all-gather) seconds of one stage (``partita.planning.sharding.collective_times_s``)."""
    times = collective_times_s(
        stage.sharding,
        trainable_bytes,
        num_replicas=stage.num_replicas,
        precision=precision,
        cluster=cluster,
        spans_nodes=comm.spans_nodes(stage.ranks, cluster),
    )
    return tuple(float(t) for t in times)


def _as_cluster(plan: Plan, cluster: Cluster | Mapping[str, Any] | None) -> Cluster:
    if cluster is None:
        cluster = plan.cluster
    return cluster if isinstance(cluster, Cluster) else Cluster.from_dict(cluster)


def _tables_per_stage(plan: Plan, costs: Costs) -> list[CostTable]:
    """The CostTable of every stage at its per-replica micro-batch size: B / (m · replicas), or with
    unequal shares (``StagePlan.replica_samples``) the largest: on one device type the replica
    with the most samples is the slowest and the fullest, and the stage waits for it."""
    if not plan.uniform_tensor_parallel:
        raise InputError(
            f"the plan's stages have different tensor-parallel degrees {[s.tensor_parallel for s in plan.stages]} "
            "(a mixed cluster's types at their own): one cost table cannot time them; simulate it with the "
            "costs of each device group at its degree (partita.planning.hetero_simulate.simulate_mixed, "
            "MixedOutcome.simulate)"
        )
    by_size: dict[int, CostTable] = {}
    tables = []
    for stage in plan.stages:
        samples = plan.num_microbatches * stage.num_replicas
        if stage.replica_samples is None and plan.global_batch_size % samples:
            raise InputError(
                f"stage {stage.index}: global batch {plan.global_batch_size} does not split into "
                f"{plan.num_microbatches} micro-batches x {stage.num_replicas} replicas: use a global "
                f"batch that is a multiple of {samples}"
            )
        size = max(stage.replica_samples) if stage.replica_samples else plan.global_batch_size // samples
        if size not in by_size:
            if isinstance(costs, CostTable):
                if costs.microbatch_size != size:
                    raise InputError(
                        f"stage {stage.index} runs micro-batches of {size} per replica, but the cost "
                        f"table is for {costs.microbatch_size}: pass a function microbatch_size -> "
                        f"CostTable instead"
                    )
                by_size[size] = costs
            else:
                by_size[size] = costs(size)
        if by_size[size].tensor_parallel != plan.tensor_parallel:
            raise InputError(
                f"the cost table is for tensor-parallel degree {by_size[size].tensor_parallel}, but the plan's is "
                f"{plan.tensor_parallel}: pass one device's costs of a group of {plan.tensor_parallel} "
                "(partita.cost.tensor_parallel.tensor_parallel_costs; PlanningResult.context.costs_at has them)"
            )
        if by_size[size].precision != plan.precision.value:
            raise InputError(
                f"the cost table is for {by_size[size].precision}, but the plan computes in {plan.precision.value}: "
                f"pass costs in the plan's precision (analytic_costs(..., precision={plan.precision.value!r}))"
            )
        tables.append(by_size[size])
    return tables

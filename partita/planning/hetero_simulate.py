"""Simulating a plan over a mixed cluster: every replica at its own device type's speed.

The event simulator (``partita.planning.simulate.simulate_pipeline``) runs one duration per stage
and action. A stage whose replicas sit on several device groups, each running its share of the
micro-batch (``StagePlan.replica_samples``), takes as long as its slowest replica: per stage,
forward and backward are the maximum over its groups of that group's times at its share
(``stages_pipeline_inputs`` on the group's one-type cluster and CostTable). Its gradient
collective runs over all its replicas, on the mixed cluster's links (a ring that crosses groups
waits for the inter-group link), and the optimizer step ends with its slowest group's. A send
between stages moves each sender's share over the link between the two stages' devices (the
inter-group link when they lie in different groups); the slowest sender's is the stage's.

Under tensor parallelism (``StagePlan.tensor_parallel``, each device type's own where they differ)
the tables are one device's of a group (its share of the work and the group's collectives,
``partita.cost.tensor_parallel``), a replica is a group, and the gradient collectives run one ring
per index of the group, as on one type. Between stages of different degrees a rank sends as many
copies as the ratio of the degrees (``_sends``).

A one-type cluster's plan gives the same inputs as ``partita.planning.simulate.pipeline_inputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from partita.cost import comm
from partita.cost.analytic import optimizer_step_s
from partita.planning.simulate import stages_pipeline_inputs
from partita.planning.simulator import simulate_pipeline
from partita.types import Accumulation, CostTable, Plan, Recompute, Sharding, SimResult, StagePlan
from partita.types.cluster import Cluster
from partita.types.schedule_orders import stage_rank_groups

__all__ = ["GroupShare", "mixed_pipeline_inputs", "simulate_mixed", "stage_groups"]

# (device group, samples per micro-batch) -> that group's CostTable
CostsByGroup = Callable[[int, int], CostTable]


@dataclass(frozen=True)
class GroupShare:
    """The replicas of one stage on one device group: their global ranks, and the samples of each
    micro-batch each of them runs."""

    group: int
    ranks: tuple[int, ...]
    samples: int


def stage_groups(stage: StagePlan, cluster: Cluster, microbatch_samples: int) -> list[GroupShare]:
    """The device groups a stage runs on, in group order, with their replicas' ranks and share: the
    largest of the group's replicas (the mixed search gives a group's replicas equal shares; a
    manual plan may not, and then the group waits for its replica with the most samples)."""
    shares = stage.samples_of_replicas(microbatch_samples)
    found: dict[int, tuple[list[int], set[int]]] = {}
    for replica, samples in enumerate(shares):
        ranks = stage.replica_ranks(replica)
        ranks_of, samples_of = found.setdefault(cluster.group_of_rank(ranks[0]), ([], set()))
        ranks_of.extend(ranks)
        samples_of.add(samples)
    result = []
    for group in sorted(found):
        ranks, samples = found[group]
        result.append(GroupShare(group, tuple(ranks), max(samples)))
    return result


@dataclass(frozen=True)
class _Stand:
    """A stage as ``stages_pipeline_inputs`` reads it: the range, recompute, sharding, the ranks
    (on the cluster it is given), the replica count and the tensor-parallel degree."""

    start: int
    stop: int
    recompute: Recompute
    sharding: Sharding
    ranks: tuple[int, ...]
    num_replicas: int
    tensor_parallel: int = 1
    accumulation: Accumulation = Accumulation.WHOLE
    recompute_blocks: int | None = None


def mixed_pipeline_inputs(plan: Plan, costs: CostsByGroup) -> dict:
    """``simulate_pipeline``'s keyword arguments for ``plan`` on its (mixed) cluster, each group's
    times from ``costs(group, samples)`` (module docstring)."""
    cluster, b = plan.cluster, plan.global_batch_size // plan.num_microbatches
    optimizer, precision = plan.options.get("optimizer", "adam"), plan.precision
    groups = stage_rank_groups(plan.schedule, plan.num_rank_groups, plan.num_stages)
    fields = ("forward_s", "backward_s", "backward_weight_s", "split_backward_s", "activation_bytes", "optimizer_s")
    per_stage: dict[str, list] = {name: [] for name in (*fields, "allreduce_s", "allreduce_tail_s", "gather_s")}
    shares_by_stage = [stage_groups(s, cluster, b) for s in plan.stages]
    for stage, shares in zip(plan.stages, shares_by_stage):
        values = {name: [] for name in fields}
        for share in shares:
            group_cluster, first = cluster.group_clusters[share.group], cluster.group_first_ranks[share.group]
            local = tuple(r - first for r in share.ranks)  # ranks on the group's own cluster
            compute = _Stand(
                stage.start,
                stage.stop,
                stage.recompute,
                Sharding.REPLICATE,
                local,
                1,
                stage.tensor_parallel,
                recompute_blocks=stage.recompute_blocks,
            )
            table = costs(share.group, share.samples)
            one = stages_pipeline_inputs([compute], [table], [0], plan.schedule, 1, precision, optimizer, group_cluster)
            for name in fields[:-1]:
                values[name].append(one[name][0])
            shards = stage.num_replicas if stage.sharding is not Sharding.REPLICATE else 1
            trainable = _trainable_bytes(table, stage.start, stage.stop)
            step_s = optimizer_step_s(trainable / shards, optimizer, group_cluster.device, precision=precision)
            values["optimizer_s"].append(cluster.compute_slowdown * step_s)
        whole = _Stand(
            stage.start,
            stage.stop,
            stage.recompute,
            stage.sharding,
            stage.ranks,
            stage.num_replicas,
            stage.tensor_parallel,
            stage.accumulation,
        )
        table = costs(shares[0].group, shares[0].samples)
        link = cluster if len(shares) > 1 else cluster.group_clusters[shares[0].group]
        ranks = (
            whole.ranks
            if len(shares) > 1
            else tuple(r - cluster.group_first_ranks[shares[0].group] for r in whole.ranks)
        )
        common = ([table], [0], plan.schedule, plan.num_microbatches, precision, optimizer, link)
        collective = stages_pipeline_inputs([_with_ranks(whole, ranks)], *common)
        gather = collective["gather_s"][0]
        reduce_shown = 0.0  # sharded accumulation: what each backward's reduce-scatter adds to it
        if whole.accumulation is Accumulation.SHARDED:
            once = stages_pipeline_inputs(
                [_with_ranks(dataclasses.replace(whole, accumulation=Accumulation.WHOLE), ranks)], *common
            )
            reduce_shown = collective["backward_s"][0] - once["backward_s"][0]
        for name in fields:
            value = max(values[name])
            if stage.sharding is Sharding.FULL_SHARD and stage.num_replicas > 1 and name in ("forward_s", "backward_s"):
                value = max(value, gather)  # each forward and backward waits for its all-gather
            per_stage[name].append(value + (reduce_shown if name == "backward_s" else 0.0))
        for name in ("allreduce_s", "allreduce_tail_s", "gather_s"):
            per_stage[name].append(collective[name][0])
    return dict(
        schedule=plan.schedule,
        num_microbatches=plan.num_microbatches,
        num_rank_groups=plan.num_rank_groups,
        send_s=_sends(plan, shares_by_stage, costs, groups),
        **per_stage,
    )


def _with_ranks(stand: _Stand, ranks: tuple[int, ...]) -> _Stand:
    return dataclasses.replace(stand, ranks=ranks)


def _trainable_bytes(table: CostTable, start: int, stop: int) -> int:
    held = table.params_in_range(start, stop)
    return int(sum(int(table.param_bytes[p]) for p in held if table.param_trainable[p]))


def _sends(plan: Plan, shares_by_stage: list[list[GroupShare]], costs: CostsByGroup, groups) -> list[float]:
    """Per boundary: the slowest sender group's transfer of its share of the cut bytes to the next
    stage (0 between stages of one rank group). Between stages of different tensor-parallel degrees
    a rank of the smaller group sends its copy to several of the larger (``partita.runtime.uneven``:
    forward or, for the gradient, backward): the ratio of the degrees in copies on its link."""
    cluster, sends = plan.cluster, []
    for k in range(plan.num_stages - 1):
        if groups[k] == groups[k + 1]:
            sends.append(0.0)
            continue
        here, after = plan.stages[k], plan.stages[k + 1]
        copies = max(here.tensor_parallel, after.tensor_parallel) // min(here.tensor_parallel, after.tensor_parallel)
        receivers = {s.group for s in shares_by_stage[k + 1]}
        slowest = 0.0
        for share in shares_by_stage[k]:
            cut_bytes = copies * float(costs(share.group, share.samples).cut_bytes[here.stop])
            if receivers == {share.group}:  # within one group: that group's links
                group_cluster, first = cluster.group_clusters[share.group], cluster.group_first_ranks[share.group]
                same_node = group_cluster.rank_to_node(share.ranks[0] - first) == group_cluster.rank_to_node(
                    after.ranks[0] - first
                )
                seconds = comm.p2p_time_s(cut_bytes, group_cluster, same_node=same_node)
            else:  # to another group: the inter-group link
                seconds = cluster.inter_group_latency_s + cut_bytes / cluster.inter_group_bandwidth_bytes_per_s
            slowest = max(slowest, seconds)
        sends.append(slowest)
    return sends


def simulate_mixed(
    plan: Plan, costs: CostsByGroup, *, keep_timeline: bool = True, step_to_beat: float | None = None
) -> SimResult | None:
    """Simulate one step of ``plan`` over its mixed cluster (``mixed_pipeline_inputs``); None as soon
    as the step surely exceeds ``step_to_beat`` (as ``simulate_pipeline``)."""
    return simulate_pipeline(
        **mixed_pipeline_inputs(plan, costs), keep_timeline=keep_timeline, step_to_beat=step_to_beat
    )

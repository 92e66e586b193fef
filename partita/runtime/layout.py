"""What layouts the runtime runs: ``check_layout`` refuses a plan whose ranks it cannot place."""

from __future__ import annotations

from partita.errors import InputError
from partita.types import Plan
from partita.types.schedule_orders import UNEVEN_SCHEDULES, stage_rank_groups

__all__ = ["check_even_shares", "check_layout"]


def check_layout(plan: Plan) -> None:
    """InputError unless the runtime can run the plan's layout: a uniform pp x dp mesh with rank
    group g on ranks [g*dp, (g+1)*dp), or an uneven plan (GPipe/1F1B, one stage per rank group)
    whose rank groups hold consecutive ranks, group g after groups 0 .. g-1."""
    check_even_shares(plan)
    if plan.uniform_replicas:
        _check_uniform_layout(plan)
    else:
        _check_uneven_layout(plan)


def check_even_shares(plan: Plan) -> None:
    """InputError for a stage whose replicas take unequal shares of a micro-batch
    (``StagePlan.replica_samples``, from planning a mixed cluster with
    ``runtime_layouts_only=False``): the runtime splits every micro-batch evenly over a stage's
    replicas, and running such a plan evenly would silently change it."""
    for s in plan.stages:
        if s.replica_samples is not None and len(set(s.replica_samples)) > 1:
            raise InputError(
                f"stage {s.index} gives its replicas unequal shares {list(s.replica_samples)} of each micro-batch, "
                "which partita's runtime does not run yet (it splits a micro-batch evenly over a stage's replicas): "
                "re-plan with partita.plan (it offers only layouts the runtime runs), or set equal shares"
            )


def _check_uniform_layout(plan: Plan) -> None:
    dp, pp, t = plan.stages[0].num_replicas, plan.num_rank_groups, plan.tensor_parallel
    placement = stage_rank_groups(plan.schedule, pp, plan.num_stages)
    for s in plan.stages:
        expected = tuple(range(s.rank_group * dp * t, (s.rank_group + 1) * dp * t))
        if s.ranks != expected or s.rank_group != placement[s.index]:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; {plan.schedule.value} "
                f"places it on rank group {placement[s.index]}, ranks {list(expected)}: build the plan with "
                "partita.plan or partita.planning.manual.manual_plan"
            )


def _check_uneven_layout(plan: Plan) -> None:
    counts = [s.num_replicas for s in plan.stages]
    if plan.schedule not in UNEVEN_SCHEDULES:
        raise InputError(
            f"the plan gives stages different replica counts {counts} under {plan.schedule.value}, "
            "which the runtime runs on uniform pp x dp meshes only: use schedule gpipe or 1f1b, or "
            "the same replica count for every stage"
        )
    if plan.num_rank_groups != plan.num_stages:
        raise InputError(
            f"the plan puts {plan.num_stages} stages on {plan.num_rank_groups} rank groups with "
            f"different replica counts {counts}: uneven plans run one stage per rank group"
        )
    first = 0
    for s in plan.stages:
        expected = tuple(range(first, first + s.num_replicas))
        if s.ranks != expected or s.rank_group != s.index:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; with replica counts "
                f"{counts} it must run on rank group {s.index}, ranks {list(expected)} (each group's ranks follow "
                "the earlier groups'): build the plan with partita.plan or partita.planning.manual.manual_plan"
            )
        first += s.num_replicas
    batch, m = plan.global_batch_size, plan.num_microbatches
    bad = [r for r in counts if batch % (m * r)]
    if bad:
        raise InputError(
            f"the global batch of {batch} samples in {m} micro-batches does not split evenly over "
            f"{bad[0]} replicas: use a global batch that is a multiple of num_microbatches x every "
            f"replica count {sorted(set(counts))}"
        )

"""Splits of interleaved and ZB-V configs whose rank groups overfill are moved until they fit
(partita.planning.group_fit), so the search keeps such configs."""

from planning_instances import head_heavy_instance

from partita.planning.build import block_to_node_boundaries
from partita.planning.chain import block_costs
from partita.planning.configs import enumerate_configs
from partita.planning.driver import best_plan
from partita.planning.group_fit import GroupFit, fitting_candidate
from partita.planning.plan_builder import plan_from_candidate
from partita.planning.search import search_config
from partita.types import Schedule


def _zbv_config(ctx, groups: int, m: int):
    return next(
        c
        for c in enumerate_configs(ctx.options, len(ctx.chain) - 1)
        if c.schedule is Schedule.ZBV and c.num_rank_groups == groups and c.num_microbatches == m
    )


def test_overfilling_zbv_splits_are_moved_until_every_rank_group_fits():
    ctx = head_heavy_instance(5.75)
    config = _zbv_config(ctx, 4, 16)
    candidates = search_config(
        block_costs(ctx.costs_at(config.microbatch_size), ctx.chain), config, ctx.options, ctx.search_cluster
    )
    assert candidates and all(plan_from_candidate(ctx, c) is None for c in candidates)  # each overfills a group
    moved = [m for c in candidates if (m := fitting_candidate(ctx, c)) is not None]
    assert moved
    for candidate in moved:
        fit = GroupFit(ctx, candidate)
        assert all(fit.overflow(g, candidate.boundaries) == 0 for g in range(config.num_rank_groups))
        plan = plan_from_candidate(ctx, candidate)
        assert plan is not None and max(s.memory_bytes for s in plan.stages) <= ctx.options.memory_limit_bytes


def test_the_group_memory_is_the_plans_own():
    """GroupFit's memory of a rank group is what the plan built from the split shows for it."""
    ctx = head_heavy_instance(16.0)
    config = _zbv_config(ctx, 2, 16)
    candidate = search_config(
        block_costs(ctx.costs_at(config.microbatch_size), ctx.chain), config, ctx.options, ctx.search_cluster
    )[0]
    plan = plan_from_candidate(ctx, candidate)
    fit = GroupFit(ctx, candidate)
    for s in plan.stages:
        assert fit.group_bytes(s.rank_group, candidate.boundaries) == s.memory_bytes
    assert block_to_node_boundaries(ctx.chain, candidate.boundaries) == [s.start for s in plan.stages] + [
        plan.stages[-1].stop
    ]


def test_zbv_is_planned_where_only_a_moved_split_fits():
    """Before the splits were moved, no ZB-V plan was found at 5.75 GiB (the search's candidates
    all overfilled a rank group)."""
    ctx = head_heavy_instance(5.75)
    plan = best_plan(ctx)
    assert plan is not None and plan.schedule is Schedule.ZBV
    assert max(s.memory_bytes for s in plan.stages) <= ctx.options.memory_limit_bytes


def test_one_stage_per_group_is_left_alone():
    ctx = head_heavy_instance(16.0, schedules=(Schedule.ONE_F_ONE_B,))
    config = next(c for c in enumerate_configs(ctx.options, len(ctx.chain) - 1) if c.num_rank_groups == 2)
    candidate = search_config(
        block_costs(ctx.costs_at(config.microbatch_size), ctx.chain), config, ctx.options, ctx.search_cluster
    )[0]
    assert fitting_candidate(ctx, candidate) is None

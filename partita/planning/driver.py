"""The search driver: candidates from the searches -> simulated plans -> refined -> the best Plan."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from partita.planning.chain import block_costs
from partita.planning.context import PlanningContext, plan_from_candidate, plan_key
from partita.planning.refine import BaselineSeeds, refine
from partita.planning.search import Candidate, search, sort_key
from partita.planning.uneven import MAX_DEVICES as UNEVEN_MAX_DEVICES
from partita.planning.uneven import search_uneven
from partita.types import Plan

# How many of the best-estimated candidates are simulated on the real schedule, and of how many
# configs the best simulated plan is refined by moving boundaries.
NUM_SIMULATED = 24


NUM_REFINED = 6


# On short chains every config is refined whose best simulated plan is within this factor of the
# best plan (refinement moves boundaries by a block or two; the oracle tests in
# tests/unit/test_search.py and test_uneven_search.py check that no optimum is lost this way).
REFINE_WITHIN = 1.2


def best_plan(ctx: PlanningContext, *, num_simulated: int = NUM_SIMULATED) -> Plan | None:
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    num_blocks = len(ctx.chain) - 1
    uneven = []
    if (
        not ctx.options.uniform_replicas and ctx.options.num_devices <= UNEVEN_MAX_DEVICES
    ):  # more: infeasible_error's trials
        uneven = search_uneven(
            blocks_at, ctx.options, ctx.search_cluster, num_blocks, cuttable=ctx.per_sample_cuts[np.asarray(ctx.chain)]
        )
    if num_blocks <= 16:  # small chains: simulate every candidate, refine every config
        candidates = _merged(search(blocks_at, ctx.options, ctx.search_cluster, num_blocks), uneven)
        simulated, candidate_of = _simulate_fitting(ctx, candidates)
        return _refine_best(ctx, simulated, candidate_of, None)
    # The pruned search returns the full list cut after its num_simulated-th candidate with one
    # stage per rank group; if fewer than num_simulated of them fit, the full list is needed.
    candidates = search(blocks_at, ctx.options, ctx.search_cluster, num_blocks, num_best=num_simulated)
    simulated, candidate_of = _simulate_fitting(ctx, _merged(candidates, uneven), num_simulated)
    if len(simulated) < num_simulated and sum(c.config.virtual_stages == 1 for c in candidates) >= num_simulated:
        candidates = search(blocks_at, ctx.options, ctx.search_cluster, num_blocks)
        simulated, candidate_of = _simulate_fitting(ctx, _merged(candidates, uneven), num_simulated)
    return _refine_best(ctx, simulated, candidate_of, NUM_REFINED)


def _merged(uniform: list[Candidate], uneven: list[Candidate]) -> list[Candidate]:
    """Both searches' candidates, by estimate (ties broken by the search's fixed key)."""
    return sorted([*uniform, *uneven], key=sort_key) if uneven else uniform


def _simulate_fitting(ctx: PlanningContext, candidates: Sequence[Candidate], limit: int | None = None):
    """Plans of the first ``limit`` candidates that fit (all: None), and the candidate of each plan.

    Candidates whose rank groups hold several stages passed the search's per-stage memory check
    only; the exact check can reject them, so keep going until ``limit`` plans fit."""
    simulated, candidate_of = [], {}
    for candidate in candidates:
        p = plan_from_candidate(ctx, candidate)
        if p is not None:
            simulated.append(p)
            candidate_of[id(p)] = candidate
            if limit is not None and len(simulated) >= limit:
                break
    return simulated, candidate_of


def _refine_best(ctx: PlanningContext, simulated: list[Plan], candidate_of: dict, num_refined: int | None):
    """Refine the best simulated plan of each of the best ``num_refined`` configs (None: all within
    REFINE_WITHIN of the best plan's step); the best result."""
    if not simulated:
        return None
    simulated.sort(key=plan_key)
    best_per_config: dict = {}
    for p in simulated:  # the best simulated plan of each config, best configs first
        best_per_config.setdefault(candidate_of[id(p)].config, p)
    to_refine = list(best_per_config.values())[:num_refined]
    if num_refined is None:
        to_refine = [p for p in to_refine if p.predicted_step_s <= simulated[0].predicted_step_s * REFINE_WITHIN]
    seeds = BaselineSeeds(ctx)
    refined = []
    for p in to_refine:
        best = refine(ctx, candidate_of[id(p)], p)
        refined.append(min([best, *seeds.refined(candidate_of[id(p)].config, best)], key=plan_key))
    return min(refined, key=plan_key)

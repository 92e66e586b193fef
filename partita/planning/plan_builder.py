"""Turning a split into a simulated Plan, and the bounds that skip splits that cannot win.

Everything after the search proper goes through here: a candidate's node boundaries become a
draft Plan (``draft_plan``: predicted stage times and memory), the draft is checked against the
memory limit, recomputation is switched on where a stage needs it, at the least level with which it
fits (``fit_with_recompute``), and the fitting plan's step is simulated on its real schedule
(``simulated``). ``step_lower_bound_s`` lets callers skip simulating splits that cannot beat a
known step (``cannot_beat``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import partita
from partita.cost.recompute import extra_backward_s
from partita.planning.build import block_to_node_boundaries, build_plan, fits, total_compute_s
from partita.planning.configs import Candidate
from partita.planning.context import PlanningContext
from partita.planning.sharding import shards_as_pinned
from partita.planning.simulate import simulate_plan
from partita.types import RECOMPUTE_LEVELS, CostTable, Plan, Recompute, StagePlan


def plan_key(p: Plan) -> tuple:
    return (round(p.predicted_step_s, 12), p.num_devices, p.boundaries)


def routable(ctx: PlanningContext, config, node_boundaries: Sequence[int]) -> bool:
    """Whether every cut between stages with different replica counts splits by sample (the
    runtime cannot route a merged batch dim such as ``(B*T, H)`` between them)."""
    if not config.stage_replicas:
        return True
    counts = config.stage_replicas
    return all(
        counts[k] == counts[k + 1] or ctx.per_sample_cuts[node_boundaries[k + 1]] for k in range(len(counts) - 1)
    )


def plan_from_candidate(ctx: PlanningContext, candidate: Candidate, method: str = "partita") -> Plan | None:
    """Build, check memory exactly (rank groups with several stages) and simulate one candidate."""
    config = candidate.config
    node_boundaries = block_to_node_boundaries(ctx.chain, candidate.boundaries)
    return finish_plan(ctx, config, node_boundaries, candidate.recompute, method)


def finish_plan(ctx: PlanningContext, config, node_boundaries, recompute, method: str) -> Plan | None:
    if not routable(ctx, config, node_boundaries):
        return None
    p = draft_plan(ctx, config, node_boundaries, recompute, method)
    return simulated(ctx, p) if fits(p, ctx.options.memory_limit_bytes) and honours_pins(ctx, p, method) else None


def honours_pins(ctx: PlanningContext, plan: Plan, method: str) -> bool:
    """Whether a plan of partita's own (``method``; the baselines' splits keep theirs) honours the
    pinned sharding level: stages sharing a weight with another stage replicate under any pin
    (``build.py``), so a plan whose every such stage does is not one the user asked for, and a
    slower plan that shards a stage must win over it."""
    if method != "partita" or not ctx.options.sharding_must_apply:
        return True
    return shards_as_pinned(plan, ctx.options.sharding)


def draft_plan(ctx: PlanningContext, config, node_boundaries, recompute, method: str) -> Plan:
    """The Plan with predicted stage times and memory, its step not yet simulated. Its
    ``total_compute_s`` is the unsplit graph's (degree 1), so that the ideal step counts every
    device once."""
    p = build_plan(
        ctx.graph,
        ctx.costs_at,
        config,
        node_boundaries,
        recompute,
        ctx.options,
        cluster=ctx.cluster,
        method=method,
        resolved_options=ctx.resolved,
        versions=(partita.__version__, torch.__version__),
        memo=ctx.build_memo,
    )
    if ctx.unsharded is None:
        return p
    whole = total_compute_s(ctx.unsharded.costs_at, config, ctx.options.global_batch_size)
    return dataclasses.replace(p, total_compute_s=whole)


def with_result(p: Plan, result) -> Plan:
    """``p`` with the step and bubble of its simulation ``result``."""
    return p.__class__(
        **{**p.__dict__, "predicted_step_s": result.step_s, "predicted_bubble_fraction": result.bubble_fraction}
    )


def simulated(ctx: PlanningContext, p: Plan, step_to_beat: float | None = None) -> Plan | None:
    """``p`` with its simulated step and bubble; None when ``step_to_beat`` is given and the step
    surely exceeds it (``cannot_beat``), which the simulator may tell before the end."""
    result = simulate_plan(
        p, ctx.costs_at, ctx.cluster, keep_timeline=False, memo=ctx.build_memo, step_to_beat=step_to_beat
    )  # only the step and bubble are kept
    return None if result is None else with_result(p, result)


def fit_with_recompute(
    ctx: PlanningContext,
    config,
    boundaries: list[int],
    method: str,
    mode: Recompute | None = None,
    *,
    step_to_beat: float | None = None,
) -> Plan | None:
    """Recompute only the stages that do not fit without it, at the least level with which they
    fit (a pinned or config-wide mode is kept).

    With ``step_to_beat``, also None when the plan cannot be faster than that: without simulating
    when ``step_lower_bound_s`` shows it, else as soon as the simulation does (``simulated``).
    """
    draft = fitting_draft(ctx, config, boundaries, method, mode, step_to_beat=step_to_beat)
    return None if draft is None else simulated(ctx, draft, step_to_beat)


def fitting_draft(
    ctx: PlanningContext,
    config,
    boundaries: list[int],
    method: str,
    mode: Recompute | None = None,
    *,
    step_to_beat: float | None = None,
) -> Plan | None:
    """``fit_with_recompute`` but for the simulation: the draft plan that fits (its step not yet
    simulated), or None (it does not fit, or ``step_lower_bound_s`` shows it cannot beat
    ``step_to_beat``). The stages of rank groups that do not fit recompute selectively, and
    those that still do not, fully."""
    if not routable(ctx, config, boundaries):
        return None
    pinned = ctx.options.recompute if mode is None else mode
    limit = ctx.options.memory_limit_bytes
    recompute = [pinned or Recompute.NONE] * config.num_stages
    draft = draft_plan(ctx, config, boundaries, recompute, method)
    if not fits(draft, limit):
        if pinned is not None:
            return None
        for level in RECOMPUTE_LEVELS[1:]:
            recompute = [
                Recompute.most([r, level]) if s.memory_bytes > limit else r for s, r in zip(draft.stages, recompute)
            ]
            if step_to_beat is not None and cannot_beat(
                draft_lower_bound_s(ctx, config, draft, recompute), step_to_beat
            ):
                return None
            draft = draft_plan(ctx, config, boundaries, recompute, method)
            if fits(draft, limit):
                break
        else:
            return None
    final = [s.recompute for s in draft.stages]
    if step_to_beat is not None and cannot_beat(draft_lower_bound_s(ctx, config, draft, final), step_to_beat):
        return None
    return draft if honours_pins(ctx, draft, method) else None


def step_lower_bound_s(config, compute_s: Sequence[float], forward_s: Sequence[float] | None = None) -> float:
    """A bound below the simulated step, from each stage's F + B seconds per micro-batch (and,
    with several stages per rank group, each stage's F seconds, ``forward_s``).

    Every rank group runs its actions one at a time, so the step is at least the busiest group's
    m (F + B). With one stage per group (GPipe, 1F1B) group g's first action is a forward, which
    waits for that micro-batch's forwards on groups 0 .. g-1, and its last a backward, after which
    that micro-batch's backwards on groups g-1 .. 0 still run: step >= sum_{k<g} (F_k + B_k) + m (F_g + B_g).
    With v stages per group (interleaved 1F1B, ZBV) group g's first action is stage g's forward of
    micro-batch 0, after the forwards of stages 0 .. g-1 (on groups 0 .. g-1), and then the group
    computes m L_g (L_g: its stages' F + B): step >= sum_{k<g} F_k + m L_g.
    """
    m = config.num_microbatches
    if config.virtual_stages == 1:
        before, bound = 0.0, 0.0
        for load in compute_s:
            bound = max(bound, before + m * load)
            before += load
        return bound
    loads = [0.0] * config.num_rank_groups
    for s, load in enumerate(compute_s):
        loads[config.rank_group_of(s)] += load
    if forward_s is None:
        return m * max(loads)
    before, bound = 0.0, 0.0
    for g, load in enumerate(loads):
        bound = max(bound, before + m * load)
        before += forward_s[g]  # stage g is group g's first
    return bound


def draft_lower_bound_s(ctx: PlanningContext, config, draft: Plan, recompute: Sequence[Recompute]) -> float:
    """``step_lower_bound_s`` of ``draft`` with ``recompute`` (a rank group recomputes all its
    stages at the most any of them takes, as the plan and the simulator count it)."""
    by_group: dict[int, Recompute] = {}
    for s in draft.stages:
        by_group[s.rank_group] = Recompute.most([by_group.get(s.rank_group, Recompute.NONE), recompute[s.index]])
    return step_lower_bound_s(
        config,
        [
            s.forward_s
            + s.backward_s
            - _recompute_s(ctx, config, s, s.recompute)
            + _recompute_s(ctx, config, s, by_group[s.rank_group])
            for s in draft.stages
        ],
        [s.forward_s for s in draft.stages],
    )


def _recompute_s(ctx: PlanningContext, config, stage: StagePlan, level: Recompute) -> float:
    """Seconds ``level`` adds to ``stage``'s backward per micro-batch (``extra_backward_s``)."""
    if level is Recompute.NONE:
        return 0.0
    table = ctx.costs_at(config.microbatch_size_of(stage.index))
    a, b = stage.start, stage.stop
    sums = ctx.build_memo.get(table, ("recomputed seconds", a, b), _forward_and_selective_s, table, a, b)
    return float(extra_backward_s(level, *sums))


def _forward_and_selective_s(table: CostTable, start: int, stop: int) -> tuple[float, float]:
    return float(table.forward_s[start:stop].sum()), float(table.selective_recompute_s[start:stop].sum())


def cannot_beat(lower_bound_s: float, step_s: float) -> bool:
    """Whether a plan whose step is at least ``lower_bound_s`` surely simulates slower than ``step_s``
    (with a margin for rounding: plans compare by their step rounded to 1e-12 s)."""
    return lower_bound_s > step_s * (1 + 1e-9) + 2e-12

"""The search driver: candidates from the searches -> simulated plans -> refined -> the best Plan."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from partita.planning.baselines import same_config
from partita.planning.chain import BlockCosts, block_costs
from partita.planning.configs import Candidate
from partita.planning.context import PlanningContext
from partita.planning.group_fit import fitting_candidate
from partita.planning.plan_builder import cannot_beat, plan_from_candidate, plan_key
from partita.planning.refine import SEED_MARGIN, BaselineSeeds, refine
from partita.planning.search import SearchCache, config_step_floor, search, sort_key
from partita.planning.uneven import MAX_DEVICES as UNEVEN_MAX_DEVICES
from partita.planning.uneven import search_uneven, seed_shapes
from partita.types import Plan

# How many of the best-estimated candidates are simulated on the real schedule, and of how many
# configs the best simulated plan is refined by moving boundaries.
NUM_SIMULATED = 24


NUM_REFINED = 6
# Configs with their own replica count per stage (``partita.planning.uneven``) are simulated and
# refined beside the uniform ones, not in their place: the uniform configs keep their NUM_SIMULATED
# and NUM_REFINED, and the uneven ones get as many again. So allowing uneven counts (the default)
# never returns a slower plan than ``uniform_replicas=True``: once it did, when uneven configs
# simulated a hair faster took the refinements from a uniform config that refined to the best plan
# (bench/uneven_replicas.py, Llama-7B on 12 H100s: 2.03 s against 1.94 s). With as many of each
# kind, the candidates simulated and the configs refined include those of the shared budget.
NUM_REFINED_UNEVEN = NUM_REFINED

# Above this many devices the NUM_REFINED configs are the best of all tensor-parallel degrees
# together, not of each degree: the refinement (a hill-climb of stage boundaries, simulated
# split by split) is much of a large plan's search, and it gains a few per cent on the
# configs it starts from, so configs whose simulated plan is slower than the best few of any
# degree rarely end best. Up to this size (every case of bench/plan_quality.py and the oracle
# tests) each degree refines its own NUM_REFINED.
REFINE_ACROSS_DEGREES_ABOVE = 64

# On short chains every config is refined whose best simulated plan is within this factor of the
# best plan (refinement moves boundaries by a block or two; the oracle tests in
# tests/unit/test_search.py and test_uneven_search.py check that no optimum is lost this way).
REFINE_WITHIN = 1.2


def best_plan(
    ctx: PlanningContext, *, num_simulated: int = NUM_SIMULATED, step_to_beat: float | None = None
) -> Plan | None:
    """The best plan of one context: its candidates simulated (``simulated_candidates``), the
    best of them refined (``refined_best``). ``step_to_beat``: a step that a plan found elsewhere
    (another tensor-parallel degree) has; configs that cannot beat it are not refined."""
    return refined_best(ctx, simulated_candidates(ctx, num_simulated=num_simulated), step_to_beat=step_to_beat)


@dataclass
class Simulated:
    """A context's simulated candidates (``simulated_candidates``), for ``refined_best``."""

    plans: list[Plan]
    candidate_of: dict  # id(plan) -> its Candidate
    num_refined: int | None  # uniform configs to refine (None: every config within REFINE_WITHIN)
    blocks_at: Callable[[int], BlockCosts]

    @property
    def best_step_s(self) -> float:
        return min((p.predicted_step_s for p in self.plans), default=float("inf"))


def simulated_candidates(
    ctx: PlanningContext, *, num_simulated: int = NUM_SIMULATED, step_to_beat: float = float("inf")
) -> Simulated:
    """Search the configs and simulate the best candidates: on long chains the first
    ``num_simulated`` uniform ones that fit, and as many uneven ones (NUM_REFINED_UNEVEN); on short
    chains every one. ``step_to_beat``: a step found elsewhere; the long-chain search skips configs
    that cannot beat it."""
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    num_blocks = len(ctx.chain) - 1
    uneven = []
    if not ctx.options.uniform_replicas and ctx.options.num_devices <= UNEVEN_MAX_DEVICES:  # every shape
        uneven = _uneven_candidates(ctx, blocks_at, None)
    if num_blocks <= 16:  # small chains: simulate every candidate, refine every config
        candidates = _merged(search(blocks_at, ctx.options, ctx.search_cluster, num_blocks), uneven)
        simulated, candidate_of = _simulate_fitting(ctx, candidates)
        _add_seeded_uneven(ctx, blocks_at, simulated, candidate_of)
        return Simulated(simulated, candidate_of, None, blocks_at)
    # The pruned search returns the full list cut after its num_simulated-th candidate with one
    # stage per rank group; if fewer than num_simulated of them fit, the full list is needed.
    cache = SearchCache()  # the full search below reuses the pruned one's configs
    candidates = search(
        blocks_at,
        ctx.options,
        ctx.search_cluster,
        num_blocks,
        num_best=num_simulated,
        cache=cache,
        step_to_beat=step_to_beat,
    )
    simulated, candidate_of = _simulate_fitting(ctx, candidates, num_simulated)
    if len(simulated) < num_simulated and sum(c.config.virtual_stages == 1 for c in candidates) >= num_simulated:
        candidates = search(blocks_at, ctx.options, ctx.search_cluster, num_blocks, cache=cache)
        simulated, candidate_of = _simulate_fitting(ctx, candidates, num_simulated)
    _add_simulated(simulated, candidate_of, _simulate_fitting(ctx, sorted(uneven, key=sort_key), num_simulated))
    _add_seeded_uneven(ctx, blocks_at, simulated, candidate_of)
    return Simulated(simulated, candidate_of, NUM_REFINED, blocks_at)


def refined_best(ctx: PlanningContext, found: Simulated, *, step_to_beat: float | None = None) -> Plan | None:
    """The best of ``found``'s plans after refining those of its best configs (``_refine_best``)."""
    return _refine_best(ctx, found.plans, found.candidate_of, found.num_refined, found.blocks_at, step_to_beat)


def _uneven_candidates(ctx: PlanningContext, blocks_at: Callable[[int], BlockCosts], seeds) -> list[Candidate]:
    """``search_uneven``'s candidates for the context (``seeds``: as it takes them)."""
    cuttable = ctx.per_sample_cuts[np.asarray(ctx.chain)]
    num_blocks = len(ctx.chain) - 1
    return search_uneven(blocks_at, ctx.options, ctx.search_cluster, num_blocks, cuttable=cuttable, seeds=seeds)


def _add_seeded_uneven(ctx: PlanningContext, blocks_at, simulated: list[Plan], candidate_of: dict) -> None:
    """Beyond UNEVEN_MAX_DEVICES units (where the replicas may differ): the uneven candidates of
    the shapes of the best simulated plans (``uneven.seed_shapes``), simulated and added."""
    if ctx.options.uniform_replicas or ctx.options.num_devices <= UNEVEN_MAX_DEVICES or not simulated:
        return
    seeds = seed_shapes([candidate_of[id(p)] for p in sorted(simulated, key=plan_key)])
    _add_simulated(simulated, candidate_of, _simulate_fitting(ctx, _uneven_candidates(ctx, blocks_at, seeds)))


def _add_simulated(simulated: list[Plan], candidate_of: dict, more: tuple[list[Plan], dict]) -> None:
    plans, of = more
    simulated.extend(plans)
    candidate_of.update(of)


def _merged(uniform: list[Candidate], uneven: list[Candidate]) -> list[Candidate]:
    """Both searches' candidates, by estimate (ties broken by the search's fixed key)."""
    return sorted([*uniform, *uneven], key=sort_key) if uneven else uniform


def _simulate_fitting(ctx: PlanningContext, candidates: Sequence[Candidate], limit: int | None = None):
    """Plans of the first ``limit`` candidates that fit (all: None), and the candidate of each plan.

    Candidates whose rank groups hold several stages passed the search's per-stage memory check
    only; the exact check can reject them: such a candidate's split is moved until every rank
    group fits (``partita.planning.group_fit``), and the search goes on until ``limit`` plans fit."""
    simulated, candidate_of = [], {}
    for candidate in candidates:
        p = plan_from_candidate(ctx, candidate)
        if p is None and (moved := fitting_candidate(ctx, candidate)) is not None:
            candidate, p = moved, plan_from_candidate(ctx, moved)
        if p is not None:
            simulated.append(p)
            candidate_of[id(p)] = candidate
            if limit is not None and len(simulated) >= limit:
                break
    return simulated, candidate_of


def _refine_best(
    ctx: PlanningContext,
    simulated: list[Plan],
    candidate_of: dict,
    num_refined: int | None,
    blocks_at: Callable[[int], BlockCosts],
    step_to_beat: float | None,
):
    """Refine the best simulated plan of each of the best ``num_refined`` uniform configs and of the
    best NUM_REFINED_UNEVEN uneven ones (None: every config within REFINE_WITHIN of the best plan's
    step); the best result.

    A config is not started from the baselines' splits when no split of the nodes under it can beat
    the best step known (``step_to_beat`` or the best simulated plan's), nor refined when besides
    no split of its blocks can: ``config_step_floor`` bounds those splits' simulated steps, so
    the result is the same."""
    if not simulated:
        return None
    simulated.sort(key=plan_key)
    best_per_config: dict = {}
    for p in simulated:  # the best simulated plan of each config, best configs first
        best_per_config.setdefault(candidate_of[id(p)].config, p)
    if num_refined is None:
        to_refine = [
            p for p in best_per_config.values() if p.predicted_step_s <= simulated[0].predicted_step_s * REFINE_WITHIN
        ]
    else:
        uneven = [p for config, p in best_per_config.items() if config.stage_replicas]
        uniform = [p for config, p in best_per_config.items() if not config.stage_replicas]
        # a context left no refinement of its own (``_shared_refinement``) refines no uneven config either
        to_refine = uniform[:num_refined] + (uneven[:NUM_REFINED_UNEVEN] if num_refined else [])
    if not to_refine:
        return simulated[0]
    seeds = BaselineSeeds(ctx)
    to_beat = min(simulated[0].predicted_step_s, float("inf") if step_to_beat is None else step_to_beat)
    options, cluster = ctx.options, ctx.search_cluster

    def hopeless(config, block_splits: bool) -> bool:  # whether no such split of config can beat to_beat
        blocks = blocks_at(config.microbatch_size)
        return cannot_beat(config_step_floor(blocks, config, options, cluster, block_splits=block_splits), to_beat)

    refined = []
    for p in to_refine:
        config = candidate_of[id(p)].config
        # the baselines' splits are node splits, not block splits: a weaker bound
        seeds_hopeless = hopeless(same_config(config), False)
        if seeds_hopeless and hopeless(config, True):
            refined.append(p)
            continue
        best = refine(ctx, candidate_of[id(p)], p)
        margin = SEED_MARGIN if p is to_refine[0] else 0.0
        refined.append(
            min([best, *([] if seeds_hopeless else seeds.refined(config, best, margin=margin))], key=plan_key)
        )
    return min(refined, key=plan_key)


def best_of_contexts(contexts: Sequence[PlanningContext]) -> list[tuple[Plan, PlanningContext]]:
    """(best plan, context) of each context that has a plan, in the order given; one context per
    tensor-parallel degree, say. Every context first simulates its candidates
    (``simulated_candidates``); then they refine, the one with the fastest simulated plan first,
    each only what could beat the best step found so far (``refined_best``'s ``step_to_beat``).
    A context's plan thus differs from its ``best_plan`` only where another context's is faster.
    On clusters of more than REFINE_ACROSS_DEGREES_ABOVE devices the contexts search from the
    largest degree down (the fewest units, the fastest search, and at that size most often the
    best), each skipping the configs that cannot beat the best simulated step of those before
    (``search``'s ``step_to_beat``), and share one budget of NUM_REFINED configs
    (``_shared_refinement``)."""
    at_scale = bool(contexts) and contexts[0].cluster.num_devices > REFINE_ACROSS_DEGREES_ABOVE
    if at_scale:
        found: list[Simulated | None] = [None] * len(contexts)
        step = float("inf")
        for i in sorted(range(len(contexts)), key=lambda i: -contexts[i].options.tensor_parallel):
            found[i] = simulated_candidates(contexts[i], step_to_beat=step)
            step = min(step, found[i].best_step_s)
        _shared_refinement(contexts, found)
    else:
        found = [simulated_candidates(ctx) for ctx in contexts]
    best_step = min((f.best_step_s for f in found), default=float("inf"))
    plans: list[Plan | None] = [None] * len(contexts)
    for i in sorted(range(len(contexts)), key=lambda i: (found[i].best_step_s, i)):
        plans[i] = refined_best(contexts[i], found[i], step_to_beat=best_step)
        if plans[i] is not None:
            best_step = min(best_step, plans[i].predicted_step_s)
    return [(p, ctx) for p, ctx in zip(plans, contexts) if p is not None]


def _shared_refinement(contexts: Sequence[PlanningContext], found: Sequence[Simulated]) -> None:
    """Give each context's ``num_refined`` its share of the NUM_REFINED best configs of all of
    them (by their best simulated plan; 0: its best simulated plan is taken unrefined). Contexts
    of idle-unit counts (``SearchOptions.idle_units``) refine their best config outside that
    budget, so they never take a refinement from the others."""
    best = []  # (plan key, context index, config) of each context's configs
    for i, f in enumerate(found):
        if contexts[i].options.idle_units:
            f.num_refined = None if f.num_refined is None else 1
            continue
        seen = set()
        for p in sorted(f.plans, key=plan_key):
            config = f.candidate_of[id(p)].config
            if config not in seen and not config.stage_replicas:  # uneven configs: NUM_REFINED_UNEVEN besides
                seen.add(config)
                best.append((plan_key(p), i, config))
    best.sort(key=lambda item: (item[0], item[1]))
    for i, f in enumerate(found):
        if f.num_refined is not None and not contexts[i].options.idle_units:
            f.num_refined = sum(1 for _, j, _ in best[:NUM_REFINED] if j == i)

"""The refinement skips splits by lower bounds on the simulated step: check that the bounds hold."""

import collections
import dataclasses
import functools
import itertools
from types import SimpleNamespace

import pytest
from planning_instances import random_instance

from partita.planning import driver, plan_builder, refine
from partita.planning.build import block_to_node_boundaries
from partita.planning.chain import block_costs
from partita.planning.configs import Candidate, Config, enumerate_configs
from partita.planning.driver import best_plan
from partita.planning.plan_builder import draft_lower_bound_s, draft_plan, fit_with_recompute, simulated
from partita.planning.refine import split_bound
from partita.planning.search import (
    SearchCache,
    _estimate_lower_bound,
    _split_lower_bound,
    estimate_step,
    rounds_s,
    search,
    search_config,
)
from partita.types import Recompute, Schedule


def configs(num_blocks: int, num_devices: int):
    """Every schedule on 1..num_devices rank groups, with a few micro-batch counts (global batch 8)."""
    for schedule, v in (
        (Schedule.GPIPE, 1),
        (Schedule.ONE_F_ONE_B, 1),
        (Schedule.INTERLEAVED_1F1B, 2),
        (Schedule.INTERLEAVED_1F1B, 3),
        (Schedule.ZBV, 2),
    ):
        for g in range(1, num_devices + 1):
            if g * v > num_blocks or (v > 1 and g == 1):
                continue
            for m in (1, 2, 4, 8):
                if schedule is Schedule.ONE_F_ONE_B and m < g:
                    continue
                if schedule is Schedule.INTERLEAVED_1F1B and m % max(1, m // g):
                    continue
                for mode in (None,) if v == 1 else (False, True):
                    yield Config(1, g, schedule, v, m, 8 // m, mode)


@pytest.mark.slow  # 12 searches
@pytest.mark.parametrize("seed", range(12))
def test_lower_bounds_never_exceed_the_simulated_step(seed):
    ctx = random_instance(seed)
    k = len(ctx.chain) - 1
    checked = 0
    for config in configs(k, ctx.cluster.num_devices):
        bound = split_bound(ctx, config)
        for inner in itertools.combinations(range(1, k), config.num_stages - 1):
            nodes = block_to_node_boundaries(ctx.chain, (0, *inner, k))
            fitted = fit_with_recompute(ctx, config, nodes, "partita", mode=config.recompute_mode)
            if fitted is None:  # with one stage per rank group the bound knows exactly what fits
                assert config.virtual_stages == 2 or bound(nodes) == float("inf")
            else:
                assert bound(nodes) <= fitted.predicted_step_s * (1 + 1e-9)
            levels = [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL]
            for recompute in ([Recompute.NONE] * config.num_stages, [levels[s % 3] for s in range(config.num_stages)]):
                draft = draft_plan(ctx, config, nodes, recompute, "partita")
                step = simulated(ctx, draft).predicted_step_s
                assert draft_lower_bound_s(ctx, config, draft, [s.recompute for s in draft.stages]) <= step * (1 + 1e-9)
                checked += 1
    assert checked > 0


def test_pruned_refinement_keeps_the_plan(monkeypatch):
    """best_plan with the bounds equals a plain hill-climb on these instances (same plan bytes)."""
    contexts = [random_instance(seed) for seed in range(20, 30)]
    original, skipped = plan_builder.cannot_beat, []

    def counted(bound, step):
        skipped.append(original(bound, step))
        return skipped[-1]

    for module in (plan_builder, refine):  # cannot_beat is used by both (fit_with_recompute and refine)
        monkeypatch.setattr(module, "cannot_beat", counted)
    pruned = [best_plan(ctx) for ctx in contexts]
    assert any(skipped)  # the bounds did skip splits
    for module in (plan_builder, refine):
        monkeypatch.setattr(module, "cannot_beat", lambda bound, step: False)
    plain = [best_plan(ctx) for ctx in contexts]
    assert sum(p is not None for p in pruned) >= 5
    for seed, a, b in zip(range(20, 30), pruned, plain):
        assert (a is None) == (b is None), seed
        if a is not None:
            assert a.to_json() == b.to_json(), seed


@pytest.mark.slow  # 12 searches
@pytest.mark.parametrize("seed", range(12))
def test_config_floors_never_exceed_a_plan_of_the_config(seed):
    """``config_step_floor`` (with which best_plan skips refining configs that cannot win) is below
    the simulated step of every split of the blocks, and without ``block_splits`` of the nodes too."""
    from partita.planning.baselines import same_config
    from partita.planning.chain import block_costs
    from partita.planning.search import config_step_floor

    ctx = random_instance(seed)
    k = len(ctx.chain) - 1
    blocks_at = functools.cache(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    checked = 0
    for config in configs(k, ctx.cluster.num_devices):
        blocks = blocks_at(config.microbatch_size)
        floor = config_step_floor(blocks, config, ctx.options, ctx.search_cluster)
        node_floor = config_step_floor(blocks, same_config(config), ctx.options, ctx.search_cluster, block_splits=False)
        for inner in itertools.combinations(range(1, k), config.num_stages - 1):
            nodes = block_to_node_boundaries(ctx.chain, (0, *inner, k))
            fitted = fit_with_recompute(ctx, config, nodes, "partita", mode=config.recompute_mode)
            if fitted is not None:
                assert floor <= fitted.predicted_step_s, (config, nodes)
                checked += 1
            seeded = fit_with_recompute(
                ctx, same_config(config), nodes, "partita", mode=same_config(config).recompute_mode
            )
            if seeded is not None:
                assert node_floor <= seeded.predicted_step_s, (config, nodes)
    assert checked > 0


@pytest.mark.parametrize("seed", range(6))
def test_search_from_a_step_to_beat_cuts_the_same_list(seed):
    """``search(step_to_beat=s)`` (the bound another tensor-parallel degree hands on) keeps every
    candidate of the pruned search's list whose estimate less its tail (the gradient collectives
    and optimizer step, which the closed form may overestimate) is at most s: no config it skips
    has one. Beside those it keeps only ZB-V candidates whose estimate less its tail and its fill
    and drain (``rounds_s``) is at most s, and nothing above s by that measure."""
    import functools

    ctx = random_instance(seed)
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    k = len(ctx.chain) - 1
    full = search(blocks_at, ctx.options, ctx.search_cluster, k, num_best=4)
    assert full
    assert all(0 < c.tail_s < c.estimate_s for c in full)  # the optimizer step, at least
    estimates = sorted(c.estimate_s - c.tail_s for c in full)
    for step in (estimates[0] * 0.5, estimates[0], estimates[len(estimates) // 2], estimates[-1], float("inf")):
        pruned = search(blocks_at, ctx.options, ctx.search_cluster, k, num_best=4, step_to_beat=step)
        kept = [c for c in full if c.estimate_s - c.tail_s <= step]
        assert [c for c in pruned if c in kept] == kept, step  # all of them, in the same order
        assert all(rounds_s(c) <= step for c in pruned), step
        assert all(c.config.schedule is Schedule.ZBV for c in pruned if c not in kept), step


def test_shared_refinement_budget_goes_to_the_best_configs_of_all_degrees():
    """Above REFINE_ACROSS_DEGREES_ABOVE devices the degrees share NUM_REFINED configs: each degree
    refines as many of its uniform configs as are among the best NUM_REFINED uniform configs of all
    (by simulated step); uneven configs (their own replica count per stage) take none of them."""
    config = collections.namedtuple("config", "name stage_replicas")

    def simulated_of(steps_by_config):
        plans, candidate_of = [], {}
        for name, steps in steps_by_config.items():
            for step in steps:
                p = SimpleNamespace(predicted_step_s=step, num_devices=8, boundaries=(0, len(plans) + 1))
                plans.append(p)
                uneven = (1, 2) if name.startswith("e") else ()
                candidate_of[id(p)] = SimpleNamespace(config=config(name, uneven))
        return driver.Simulated(plans, candidate_of, driver.NUM_REFINED, None)

    # best steps 1, 2, 3, 4; the uneven e0 (0.7) is refined besides the budget (NUM_REFINED_UNEVEN)
    fast = simulated_of({**{f"a{i}": [1.0 + i, 9.0] for i in range(4)}, "e0": [0.7]})
    slow = simulated_of({f"b{i}": [2.5 + i] for i in range(5)})  # 2.5, 3.5, 4.5, 5.5, 6.5
    none = simulated_of({"c": [50.0]})
    idle = simulated_of({"d": [0.5]})  # a context of idle-unit counts: its best config, outside the budget
    degree = SimpleNamespace(options=SimpleNamespace(idle_units=False))
    contexts = [degree, degree, degree, SimpleNamespace(options=SimpleNamespace(idle_units=True))]
    driver._shared_refinement(contexts, [fast, slow, none, idle])
    # the best six: 1 (a0), 2 (a1), 2.5 (b0), 3 (a2), 3.5 (b1), 4 (a3)
    assert (fast.num_refined, slow.num_refined, none.num_refined, idle.num_refined) == (4, 2, 0, 1)


@pytest.mark.parametrize("seed", range(6))
def test_split_lower_bound_never_exceeds_an_estimate(seed):
    """The pruned search skips a one-stage-per-group config whose (m - 1) B_G + T exceeds its bound:
    check that no candidate of any such config estimates below it."""
    ctx = random_instance(seed)
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    k, cache, checked = len(ctx.chain) - 1, SearchCache(), 0
    for config in enumerate_configs(ctx.options, k):
        if config.virtual_stages != 1:
            continue
        blocks = blocks_at(config.microbatch_size)
        bound = _split_lower_bound(blocks, config, cache)
        for candidate in search_config(blocks, config, ctx.options, ctx.search_cluster):
            assert bound <= candidate.estimate_s, (config, bound, candidate.estimate_s)
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("seed", range(6))
def test_estimate_lower_bound_never_exceeds_an_estimate(seed):
    """The pruned search stops at the first config (sorted by it) whose ``_estimate_lower_bound``
    exceeds its bound: no candidate of any config, of any schedule, stage count per rank group
    (interleaved 1F1B with 2 and 3) and recomputation mode, estimates below it."""
    ctx = random_instance(seed, num_nodes=(6, 12))
    options = dataclasses.replace(ctx.options, num_devices=4)
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    k, checked = len(ctx.chain) - 1, set()
    for config in enumerate_configs(options, k):
        blocks = blocks_at(config.microbatch_size)
        bound = _estimate_lower_bound(blocks, config)
        for candidate in search_config(blocks, config, options, ctx.search_cluster):
            assert bound <= candidate.estimate_s, (config, bound, candidate.estimate_s)
            checked.add((config.virtual_stages, config.recompute_mode))
    assert {(1, None), (2, Recompute.FULL), (3, Recompute.SELECTIVE)} <= checked, checked


@pytest.mark.parametrize("seed", range(6))
def test_neighbour_bounds_equal_the_bounds_one_by_one(seed):
    """``SplitBound.neighbours`` (the changed stages only, the running sums of all splits at once)
    gives each neighbour the very bound of ``bound(split)``."""
    ctx = random_instance(seed, num_nodes=(6, 10))
    k = len(ctx.chain) - 1
    compared = 0
    for config in configs(k, ctx.cluster.num_devices):
        bound = split_bound(ctx, config)
        for inner in itertools.islice(itertools.combinations(range(1, k), config.num_stages - 1), 6):
            here = (0, *inner, k)
            moves = refine.neighbours(list(here))
            splits = [block_to_node_boundaries(ctx.chain, m) for m in moves]
            fresh = split_bound(ctx, config)  # nothing remembered from the neighbours first
            assert fresh.neighbours(block_to_node_boundaries(ctx.chain, here), splits) == [bound(s) for s in splits]
            compared += len(splits)
    assert compared > 0


def test_a_search_cache_over_its_budget_drops_stage_costs_and_finds_the_same_candidates():
    """``SearchCache`` keeps its StageCosts within a byte budget (a 1T model at fine blocks made
    more than 24 GB of them): at budget 0 it holds only the one in use, and every config's
    candidates are those of an unbounded cache (a dropped StageCosts is rebuilt alike)."""
    ctx = random_instance(3, num_nodes=(6, 12))
    options = dataclasses.replace(ctx.options, num_devices=4)
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    k = len(ctx.chain) - 1
    unbounded, tight = SearchCache(), SearchCache(budget_bytes=0)
    searched = 0
    for config in enumerate_configs(options, k):
        blocks = blocks_at(config.microbatch_size)
        want = search_config(blocks, config, options, ctx.search_cluster, unbounded)
        got = search_config(blocks, config, options, ctx.search_cluster, tight)
        assert got == want, config
        assert len(tight._stage_costs) <= 1
        searched += 1
    assert searched > 10 and len(unbounded._stage_costs) > 1


def test_rounds_against_other_plans_leave_out_zbv_fill_and_drain():
    """``rounds_s``: the estimate less its tail; for ZB-V also less interleaved 1F1B's fill and
    drain, ``(G - 1) / v`` of a group's load, which its weight-gradient passes fill."""
    zbv = Config(
        replicas=2,
        num_rank_groups=5,
        schedule=Schedule.ZBV,
        virtual_stages=2,
        num_microbatches=12,
        microbatch_size=1,
        recompute_mode=Recompute.NONE,
    )
    interleaved = dataclasses.replace(zbv, schedule=Schedule.INTERLEAVED_1F1B)
    load, tail = 0.25, 0.5  # one group's time per micro-batch; what follows the last backward
    estimate = estimate_step(zbv, [load / 2] * 10) + tail
    assert estimate == pytest.approx((12 + 4 / 2) * load + tail)
    assert rounds_s(Candidate(zbv, (), (), estimate, tail)) == pytest.approx(12 * load)
    assert rounds_s(Candidate(interleaved, (), (), estimate, tail)) == pytest.approx(estimate - tail)

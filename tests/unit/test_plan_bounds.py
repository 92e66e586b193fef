"""The refinement skips splits by lower bounds on the simulated step: check that the bounds hold."""

import itertools

import pytest

from partita.plan.build import block_to_node_boundaries
from partita.plan.search import Config
from partita.planner import _draft_lower_bound_s, _draft_plan, _fit_with_recompute, _simulated, _split_bound, best_plan
from partita.types import Schedule
from tests.unit.test_search import random_instance


def configs(num_blocks: int, num_devices: int):
    """Every schedule on 1..num_devices rank groups, with a few micro-batch counts (global batch 8)."""
    for schedule, v in ((Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED_1F1B, 2),
                        (Schedule.ZBV, 2)):
        for g in range(1, num_devices + 1):
            if g * v > num_blocks or (v == 2 and g == 1):
                continue
            for m in (1, 2, 4, 8):
                if schedule is Schedule.ONE_F_ONE_B and m < g:
                    continue
                if schedule is Schedule.INTERLEAVED_1F1B and m % max(1, m // g):
                    continue
                for mode in ((None,) if v == 1 else (False, True)):
                    yield Config(1, g, schedule, v, m, 8 // m, mode)


@pytest.mark.parametrize("seed", range(12))
def test_lower_bounds_never_exceed_the_simulated_step(seed):
    ctx = random_instance(seed)
    k = len(ctx.chain) - 1
    checked = 0
    for config in configs(k, ctx.cluster.num_devices):
        bound = _split_bound(ctx, config)
        for inner in itertools.combinations(range(1, k), config.num_stages - 1):
            nodes = block_to_node_boundaries(ctx.chain, (0, *inner, k))
            fitted = _fit_with_recompute(ctx, config, nodes, "partita", mode=config.recompute_mode)
            if fitted is None:  # with one stage per rank group the bound knows exactly what fits
                assert config.virtual_stages == 2 or bound(nodes) == float("inf")
            else:
                assert bound(nodes) <= fitted.predicted_step_s * (1 + 1e-9)
            for recompute in ([False] * config.num_stages, [s % 2 == 0 for s in range(config.num_stages)]):
                draft = _draft_plan(ctx, config, nodes, recompute, "partita")
                step = _simulated(ctx, draft).predicted_step_s
                assert _draft_lower_bound_s(config, draft, [s.recompute for s in draft.stages]) <= step * (1 + 1e-9)
                checked += 1
    assert checked > 0


def test_pruned_refinement_keeps_the_plan():
    """best_plan with the bounds equals a plain hill-climb on these instances (same plan bytes)."""
    import partita.planner as planner

    for seed in range(20, 30):
        ctx = random_instance(seed)
        pruned = best_plan(ctx)
        original = planner._cannot_beat
        planner._cannot_beat = lambda bound, step: False
        try:
            plain = best_plan(ctx)
        finally:
            planner._cannot_beat = original
        assert (pruned is None) == (plain is None)
        if pruned is not None:
            assert pruned.to_json() == plain.to_json()

"""The baselines' splits start refinements where they are close to the config's refined plan."""

import dataclasses

from planning_instances import head_heavy_instance

from partita.planning.baselines import same_config
from partita.planning.configs import enumerate_configs
from partita.planning.plan_builder import fit_with_recompute
from partita.planning.refine import SEED_MARGIN, BaselineSeeds
from partita.types import Schedule


def test_seeds_a_little_behind_the_refined_plan_are_refined_too():
    """For the best config (``margin=SEED_MARGIN``) a seed within the margin of the refined plan
    starts a refinement (a hill-climb that starts a little behind can end ahead); one further
    behind does not, nor, for the other configs (no margin), one behind at all."""
    ctx = head_heavy_instance(16.0, schedules=(Schedule.ONE_F_ONE_B,))
    config = next(c for c in enumerate_configs(ctx.options, len(ctx.chain) - 1) if c.num_rank_groups == 2)
    seeds = BaselineSeeds(ctx)
    same = same_config(config)
    starts = [
        fit_with_recompute(ctx, same, b, "partita", mode=same.recompute_mode) for b in seeds.splits(same).values() if b
    ]
    seed = min((p for p in starts if p is not None), key=lambda p: p.predicted_step_s)
    close = dataclasses.replace(seed, predicted_step_s=seed.predicted_step_s / (1 + SEED_MARGIN / 2))
    far = dataclasses.replace(seed, predicted_step_s=seed.predicted_step_s / (1 + 2 * SEED_MARGIN))
    refined = seeds.refined(config, close, margin=SEED_MARGIN)
    assert refined and min(p.predicted_step_s for p in refined) <= seed.predicted_step_s
    assert seeds.refined(config, far, margin=SEED_MARGIN) == []
    assert seeds.refined(config, close) == []
    ahead = dataclasses.replace(seed, predicted_step_s=seed.predicted_step_s * 1.01)
    assert seeds.refined(config, ahead)  # a seed that beats the refined plan, as before

"""SplitSteps simulates splits without building their Plans: the same fit, recomputation, sharding
and step, bit for bit, as the Plan that ``fitting_draft`` builds and ``simulated`` simulates."""

import itertools

import numpy as np
import pytest
from planning_instances import random_instance

import partita
from partita import examples
from partita.planning.build import block_to_node_boundaries
from partita.planning.configs import enumerate_configs
from partita.planning.context import planning_context
from partita.planning.degree_contexts import degree_contexts
from partita.planning.options import PlanOptions
from partita.planning.plan_builder import fitting_draft, plan_key, simulated
from partita.planning.split_steps import SplitSteps


def _splits(ctx, config, rng, most=12):
    k = len(ctx.chain) - 1
    inner = list(itertools.combinations(range(1, k), config.num_stages - 1))
    picked = rng.permutation(len(inner))[:most]
    return [block_to_node_boundaries(ctx.chain, (0, *inner[i], k)) for i in picked]


def _check(ctx, config, splits):
    steps = SplitSteps(ctx, config)
    compared = 0
    for nodes, fitted in zip(splits, steps.fitted(splits)):
        draft = fitting_draft(ctx, config, nodes, "partita", mode=config.recompute_mode)
        assert (fitted is None) == (draft is None), (config, nodes)
        if draft is None:
            continue
        plan = simulated(ctx, draft)
        assert fitted.result.step_s == plan.predicted_step_s
        assert fitted.result.bubble_fraction == plan.predicted_bubble_fraction
        assert fitted.recompute == tuple(s.recompute for s in plan.stages)
        assert steps.key(nodes, fitted) == plan_key(plan)
        assert steps.plan(nodes, fitted) == plan
        compared += 1
    return compared


@pytest.mark.parametrize("seed", range(8))
def test_the_same_steps_as_the_built_plans_on_random_chains(seed):
    ctx = random_instance(seed, num_nodes=(4, 9))
    rng = np.random.default_rng(seed)
    compared = sum(
        _check(ctx, config, _splits(ctx, config, rng, most=4))
        for config in enumerate_configs(ctx.options, len(ctx.chain) - 1)
    )
    assert compared > 0


def test_the_same_steps_with_sharding_recomputation_and_tensor_parallelism():
    """GPT-2 tiny on 8 GPUs at a memory that makes stages shard or recompute, at every degree."""
    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = partita.Cluster(device="h100", num_devices=8, devices_per_node=4, memory_bytes=1_400_000)
    ctx = planning_context(graph, cluster=cluster, global_batch_size=16, options=PlanOptions(max_blocks=12))
    rng = np.random.default_rng(0)
    compared, levels, recomputed = 0, set(), False
    for c in degree_contexts(ctx, None):
        configs = list(enumerate_configs(c.options, len(c.chain) - 1))
        for i in rng.permutation(len(configs))[:25]:
            splits = _splits(c, configs[i], rng, most=3)
            compared += _check(c, configs[i], splits)
            for fitted, nodes in zip(SplitSteps(c, configs[i]).fitted(splits), splits):
                if fitted is not None:
                    p = SplitSteps(c, configs[i]).plan(nodes, fitted)
                    levels |= {s.sharding for s in p.stages}
                    recomputed |= any(fitted.recompute)
    assert compared >= 10 and len(levels) > 1 and recomputed, (compared, levels, recomputed)

"""Uneven replica counts per stage (uniform_replicas=False): the device-axis DP against brute force."""

import dataclasses

import numpy as np
import pytest
from planning_instances import NUM_INSTANCES, chain_instance, oracle, random_instance

import partita
from partita.errors import InputError
from partita.planning.api import plan
from partita.planning.baselines import baseline_plans
from partita.planning.configs import SearchOptions
from partita.planning.context import PlanningContext
from partita.planning.driver import best_plan
from partita.planning.options import PlanOptions
from partita.planning.simulate import simulate
from partita.types import OptimizerKind, Schedule
from partita.types.cluster import Cluster
from partita.types.plan_file import load_plan, plan_to_json


def uneven_instance(seed: int) -> PlanningContext:
    """A random chain of 2-6 nodes (planning_instances.random_instance) on 2-6 devices, uneven replicas allowed."""
    ctx = random_instance(seed, (2, 7))
    n = 2 + seed % 5
    cluster = Cluster(device="h100", num_devices=n, devices_per_node=8, memory_bytes=ctx.cluster.memory_bytes)
    options = dataclasses.replace(ctx.options, num_devices=n, uniform_replicas=False)
    return PlanningContext(ctx.graph, cluster, options, ctx.costs_at, ctx.chain, {})


def uniform(ctx: PlanningContext) -> PlanningContext:
    return dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, uniform_replicas=True))


@pytest.fixture(scope="module")
def solved():
    """(context, best_plan, oracle, best uniform plan) of NUM_INSTANCES random instances."""
    instances = map(uneven_instance, range(NUM_INSTANCES))
    return [(ctx, best_plan(ctx), oracle(ctx), best_plan(uniform(ctx))) for ctx in instances]


@pytest.mark.slow  # the brute-force oracle on NUM_INSTANCES uneven instances (the solved fixture)
def test_uneven_search_matches_brute_force(solved):
    """Within 1% of the optimum over every split, schedule, micro-batch count and replica vector;
    memory always fits; a plan whenever one exists."""
    ratios = []
    for seed, (ctx, found, best, _) in enumerate(solved):
        assert (found is None) == (best is None), seed
        if best is None:
            continue
        ratios.append(found.predicted_step_s / best.predicted_step_s)
        assert all(s.memory_bytes <= ctx.options.memory_limit_bytes for s in found.stages), seed
    ratios = np.array(ratios)
    assert len(ratios) >= NUM_INSTANCES // 2
    assert ratios.min() >= 1 - 1e-9
    assert ratios.max() <= 1.01, (np.argmax(ratios), ratios.max())


@pytest.mark.slow  # the solved fixture: the brute-force oracle on NUM_INSTANCES instances
def test_uneven_plans_are_never_slower_and_often_faster_than_uniform(solved):
    faster = 0
    for seed, (_ctx, found, _, flat) in enumerate(solved):
        if flat is None:
            continue
        assert found.predicted_step_s <= flat.predicted_step_s * (1 + 1e-12), seed
        faster += found.predicted_step_s < flat.predicted_step_s * 0.99
    assert faster >= NUM_INSTANCES // 5  # 3, 5 and 6 devices hold no pp x dp mesh of every shape


@pytest.mark.slow  # the solved fixture: the brute-force oracle on NUM_INSTANCES instances
def test_uneven_plan_layout(solved):
    """Consecutive ranks per stage, each count divides the micro-batch, one stage per rank group,
    GPipe or 1F1B, and the simulator sees each stage at its own per-replica micro-batch size."""
    num_uneven = 0
    for ctx, found, _, _ in solved:
        if found is None or found.uniform_replicas:
            continue
        num_uneven += 1
        assert found.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
        assert found.num_stages == found.num_rank_groups
        samples = found.global_batch_size // found.num_microbatches
        ranks = [r for s in found.stages for r in s.ranks]
        assert ranks == list(range(len(ranks))) and len(ranks) <= ctx.options.num_devices
        assert all(samples % s.num_replicas == 0 for s in found.stages)
        assert found.microbatch_size == samples // min(s.num_replicas for s in found.stages)
        for s in found.stages:
            table = ctx.costs_at(samples // s.num_replicas)
            assert s.forward_s == pytest.approx(float(table.forward_s[s.start : s.stop].sum()))
        assert simulate(found, ctx.costs_at, ctx.cluster).step_s == pytest.approx(found.predicted_step_s)
    assert num_uneven >= NUM_INSTANCES // 5


@pytest.mark.slow  # the solved fixture: the brute-force oracle on NUM_INSTANCES instances
def test_uneven_plan_round_trips_and_is_deterministic(tmp_path, solved):
    ctx, found = next((ctx, p) for ctx, p, _, _ in solved if p is not None and not p.uniform_replicas)
    again = best_plan(ctx)
    assert plan_to_json(found) == plan_to_json(again)
    path = tmp_path / "plan.json"
    found.save(str(path))
    assert load_plan(str(path)) == found


def test_pinned_replicas_conflict_with_uneven_replicas(gpt2_context):
    graph, cluster = gpt2_context.graph, gpt2_context.cluster
    with pytest.raises(InputError, match="replicas=2 pins.*uniform_replicas=False.*drop one of the two"):
        plan(graph, cluster=cluster, global_batch_size=24, options=PlanOptions(replicas=2, uniform_replicas=False))
    pinned = plan(graph, cluster=cluster, global_batch_size=24, options=PlanOptions(replicas=1))  # default: uniform
    assert pinned.uniform_replicas and pinned.stages[0].num_replicas == 1


@pytest.mark.slow  # a full uneven search of GPT-2 (about 9 s)
def test_by_default_uneven_counts_are_searched(gpt2_context):
    graph, cluster = gpt2_context.graph, gpt2_context.cluster
    options = PlanOptions(schedules="1f1b", num_stages=2)
    flat = plan(graph, cluster=cluster, global_batch_size=24, options=options.replace(uniform_replicas=True))
    default = plan(graph, cluster=cluster, global_batch_size=24, options=options)
    explicit = plan(graph, cluster=cluster, global_batch_size=24, options=options.replace(uniform_replicas=False))
    assert flat.uniform_replicas and not default.uniform_replicas  # 3 devices: 2 + 1 beats 1 + 1
    assert default.predicted_step_s == explicit.predicted_step_s < flat.predicted_step_s
    assert default.options["uniform_replicas"] is False and flat.options["uniform_replicas"] is True
    big = Cluster(device="h100", num_devices=128, devices_per_node=8)
    assert plan(graph, cluster=big, global_batch_size=256).options["uniform_replicas"] is False


@pytest.mark.slow  # Llama-7B captured on meta (about 8 s) and planned twice
def test_uneven_configs_do_not_take_the_uniform_configs_refinements():
    """A long chain where uneven configs simulate a hair faster than the uniform config that
    refines to the best plan: allowing uneven counts must still find that plan (it returned 2.03 s
    against 1.94 s when both kinds shared one budget of simulations and refinements)."""
    from partita import examples
    from partita.planning.context import planning_context

    ex = examples.build("llama-7b", batch_size=2, device="meta")
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cluster = Cluster(device="h100", num_devices=12, devices_per_node=6, memory_bytes=40 * 2**30)
    steps = {}
    for uniform_replicas in (True, False):
        options = PlanOptions(schedules=tuple(Schedule), uniform_replicas=uniform_replicas, costs="analytic")
        steps[uniform_replicas] = best_plan(
            planning_context(graph, cluster=cluster, global_batch_size=96, options=options)
        ).predicted_step_s
    assert steps[False] <= steps[True] * (1 + 1e-12), steps


def heavy_tail(num_devices: int, uniform_replicas: bool | None) -> PlanningContext:
    """Four layers, the last three times as slow as each of the others, 1F1B over 2 stages and
    2 micro-batches of 216 samples (pinned, so that the brute force stays small)."""
    ctx = chain_instance(
        np.array([1e-2, 1e-2, 1e-2, 3e-2]),
        np.full(4, 50 * 2**20),
        np.full(4, 20 * 2**20),
        np.array([0, 2**20, 2**20, 2**20, 0]),
        1e-4,
        num_devices,
        80 * 2**30,
        "heavy-tail",
        global_batch_size=432,
    )
    options = dataclasses.replace(
        ctx.options,
        uniform_replicas=uniform_replicas,
        schedules=(Schedule.ONE_F_ONE_B,),
        num_stages=2,
        num_microbatches=2,
    )
    return dataclasses.replace(ctx, options=options)


def test_beyond_64_devices_uneven_counts_are_searched_at_the_best_uniform_shapes(tmp_path):
    """On 72 devices the uniform search's best shape is searched again with per-stage counts: the
    slow last layer gets 54 of the 72 devices, the brute force's optimum, faster than 36 + 36;
    its ranks are consecutive and the plan file round-trips."""
    found = best_plan(heavy_tail(72, False))
    best = oracle(heavy_tail(72, False))
    flat = best_plan(heavy_tail(72, True))
    assert [s.num_replicas for s in flat.stages] == [36, 36]
    assert [s.num_replicas for s in found.stages] == [18, 54] == [s.num_replicas for s in best.stages]
    assert found.predicted_step_s == pytest.approx(best.predicted_step_s, rel=1e-12)
    assert found.predicted_step_s < flat.predicted_step_s * 0.99
    assert [r for s in found.stages for r in s.ranks] == list(range(72))
    found.save(str(tmp_path / "plan.json"))
    assert load_plan(str(tmp_path / "plan.json")) == found


@pytest.mark.parametrize("seed", range(0, 200, 7))
def test_seeded_uneven_search_equals_the_full_one_on_the_seed_shapes(seed, monkeypatch):
    """``seeds`` restricts the uneven search to some shapes (and, near a seed's count, to some
    replica counts): with every count kept, its candidates are the full search's on those shapes."""
    from partita.planning import uneven
    from partita.planning.chain import block_costs

    ctx = uneven_instance(seed)
    blocks_at = lambda b: block_costs(ctx.costs_at(b), ctx.chain)  # noqa: E731
    num_blocks = len(ctx.chain) - 1
    full = uneven.search_uneven(blocks_at, ctx.options, ctx.search_cluster, num_blocks)
    shapes = list(uneven.enumerate_shapes(ctx.options, num_blocks))[::2]
    monkeypatch.setattr(uneven, "NEAR_SEED", 10**9)
    seeded = uneven.search_uneven(
        blocks_at, ctx.options, ctx.search_cluster, num_blocks, seeds=[(shape, 1) for shape in shapes]
    )

    def shape_of(c):
        return (c.config.schedule, c.config.num_stages, c.config.num_microbatches, c.config.recompute_mode)

    assert seeded == [c for c in full if shape_of(c) in set(shapes)]


def test_seed_shapes_are_the_best_uniform_configs_an_uneven_config_can_have():
    from partita.planning.configs import Candidate, Config
    from partita.planning.uneven import seed_shapes

    def candidate(schedule, stages, m, replicas, virtual=1):
        return Candidate(Config(replicas, stages, schedule, virtual, m, 1, None), (), (), 0.0)

    candidates = [
        candidate(Schedule.ZBV, 4, 8, 2, virtual=2),  # two stages per rank group: no uneven config
        candidate(Schedule.GPIPE, 1, 8, 64),  # one stage: one count
        candidate(Schedule.ONE_F_ONE_B, 4, 8, 16),
        candidate(Schedule.ONE_F_ONE_B, 4, 8, 16),  # the same shape again
        candidate(Schedule.GPIPE, 2, 4, 32),
        candidate(Schedule.ONE_F_ONE_B, 8, 16, 8),
    ]
    assert seed_shapes(candidates, limit=2) == [
        ((Schedule.ONE_F_ONE_B, 4, 8, None), 16),
        ((Schedule.GPIPE, 2, 4, None), 32),
    ]


def test_uneven_search_respects_pinned_choices():
    ctx = uneven_instance(4)
    pinned = SearchOptions(
        **{
            **ctx.options.__dict__,
            "schedules": (Schedule.ONE_F_ONE_B,),
            "num_microbatches": 2,
            "num_stages": 2,
            "optimizer": OptimizerKind.ADAM,
        }
    )
    p = best_plan(dataclasses.replace(ctx, options=pinned))
    assert p is not None and p.schedule is Schedule.ONE_F_ONE_B and p.num_microbatches == 2 and p.num_stages == 2


@pytest.fixture(scope="module")
def gpt2_context():
    from partita import examples
    from partita.planning.context import planning_context

    ex = examples.build("gpt2-tiny", batch_size=4, device="meta")
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cluster = Cluster(device="h100", num_devices=3, devices_per_node=8)
    return planning_context(
        graph, cluster=cluster, global_batch_size=24, options=PlanOptions(uniform_replicas=False, costs="analytic")
    )


def test_replica_counts_change_only_where_tensors_split_by_sample(gpt2_context):
    """A cut crossed by a merged (B*T, H) tensor cannot separate 2 replicas from 1 (the runtime
    could not route it); the same cut between equal counts, and a layer start, can."""
    from partita.planning.chain import layer_boundaries, per_sample_cuts
    from partita.planning.configs import Config
    from partita.planning.plan_builder import finish_plan

    ctx = gpt2_context
    graph = ctx.graph
    merged = next(
        c
        for c in range(1, graph.num_nodes)
        if not per_sample_cuts(graph)[c]
        and finish_plan(
            ctx, Config(1, 2, Schedule.ONE_F_ONE_B, 1, 4, 6, None), [0, c, graph.num_nodes], [False, False], "x"
        )
        is not None
    )
    uneven = Config(1, 2, Schedule.ONE_F_ONE_B, 1, 4, 6, None, stage_replicas=(2, 1))
    assert finish_plan(ctx, uneven, [0, merged, graph.num_nodes], [False, False], "x") is None
    layer = layer_boundaries(graph)[1]
    p = finish_plan(ctx, uneven, [0, layer, graph.num_nodes], [False, False], "x")
    assert p is not None and [s.num_replicas for s in p.stages] == [2, 1]


def test_searched_uneven_plans_cut_where_tensors_split_by_sample(gpt2_context):
    from partita.planning.chain import per_sample_cuts

    ctx = gpt2_context
    pinned = dataclasses.replace(
        ctx, options=dataclasses.replace(ctx.options, schedules=(Schedule.ONE_F_ONE_B,), num_stages=2)
    )
    p = best_plan(pinned)
    assert p is not None and not p.uniform_replicas  # 3 devices, 2 stages: 2 + 1
    cuts = per_sample_cuts(ctx.graph)
    baselines = baseline_plans(pinned, p)
    assert all(b is not None for b in baselines.values()), baselines  # they cut by sample too
    for plan_ in (p, *baselines.values()):
        assert [s.num_replicas for s in plan_.stages] == [s.num_replicas for s in p.stages]
        for a, b in zip(plan_.stages, plan_.stages[1:]):
            assert a.num_replicas == b.num_replicas or cuts[b.start]
        assert p.predicted_step_s <= plan_.predicted_step_s + 1e-12


@pytest.mark.slow  # the solved fixture, and every baseline of each
def test_no_baseline_split_beats_an_uneven_plan_under_its_configuration(solved):
    num_compared = 0
    for seed, (ctx, found, _, _) in enumerate(solved):
        if found is None or found.uniform_replicas:
            continue
        for method, p in baseline_plans(ctx, found).items():
            if p is not None:
                num_compared += 1
                assert found.predicted_step_s <= p.predicted_step_s + 1e-9, (seed, method)
    assert num_compared >= 60


def test_an_uneven_config_needs_a_cost_table_per_micro_batch_size():
    from partita.planning.build import stage_tables
    from partita.planning.configs import Config

    ctx = uneven_instance(3)
    uneven = Config(1, 2, Schedule.ONE_F_ONE_B, 1, 2, 4, None, stage_replicas=(2, 1))
    with pytest.raises(InputError, match="pass a function microbatch_size -> CostTable"):
        stage_tables(ctx.costs_at(4), uneven)
    tables = stage_tables(ctx.costs_at, uneven)
    assert [t.microbatch_size for t in tables] == [2, 4]

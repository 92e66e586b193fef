"""Planning over a mixed cluster (two device types): the mixed search against brute force on small
instances (tests/unit/mixed_instances.py, oracle.brute_force_mixed), and partita.plan end to end."""

import dataclasses

import numpy as np
import pytest
from mixed_instances import mixed_instance, mixed_oracle
from planning_instances import NUM_INSTANCES

import partita
from partita.cli.main import main
from partita.planning.api import plan_with_baselines
from partita.planning.hetero import FASTEST_ONLY, SLOWEST_EVERYWHERE, best_mixed
from partita.planning.hetero_search import enumerate_mixed_configs
from partita.runtime.layout import check_layout
from partita.types.cluster import Cluster, DeviceGroup
from partita.types.plan_file import plan_from_json

# Instances whose brute force takes under a second here (2-8 devices, 2-5 nodes, batches 2-8).
QUICK_SEEDS = (0, 3, 5, 6, 7, 8, 9, 13, 16)


def _check_against_oracle(seeds, every_share: bool = False) -> list[float]:
    """The search's plan (a few balanced shares per stage, or ``every_share``) against the brute-force
    optimum over every share and layout, which partita's runtime runs."""
    ratios = []
    for seed in seeds:
        run = mixed_instance(seed, every_share=every_share)
        found, _ = best_mixed(run)
        best = mixed_oracle(run)
        assert (found is None) == (best is None), seed
        if best is None:
            continue
        ratios.append(found.predicted_step_s / best.predicted_step_s)
        limits = [ctx.options.memory_limit_bytes for ctx in run.contexts]
        for stage in found.stages:
            assert all(used <= limit for used, limit in zip(stage.memory_bytes_by_group, limits)), seed
        check_layout(found)  # the runtime runs it
    return ratios


def test_mixed_search_matches_brute_force_on_quick_instances():
    ratios = np.array(_check_against_oracle(QUICK_SEEDS))
    assert len(ratios) == len(QUICK_SEEDS)
    assert ratios.min() >= 1 - 1e-9 and ratios.max() <= 1 + 1e-9, ratios


def test_every_share_matches_brute_force():
    """``MixedRun.every_share``: the search tries every split of a micro-batch, as the oracle does."""
    ratios = np.array(_check_against_oracle(QUICK_SEEDS, every_share=True))
    assert len(ratios) == len(QUICK_SEEDS)
    assert ratios.min() >= 1 - 1e-9 and ratios.max() <= 1 + 1e-9, ratios


def test_the_search_offers_the_second_group_first():
    """Type blocks in either order of the groups: a pipeline may start on the second (slow) group,
    its ranks following the device groups (the runtime runs it: partita.runtime.layout)."""
    run = mixed_instance(3)
    first_on_second = [
        c.kinds
        for c in enumerate_mixed_configs(run, run.contexts[0].options)
        if c.kinds[0].groups == (1,) and any(k.groups == (0,) for k in c.kinds[1:])
    ]
    assert first_on_second
    ranks = run.cluster.assign_ranks([k.counts for k in first_on_second[0]])
    assert min(ranks[0]) > min(ranks[-1])  # the first stage holds later ranks than a later stage


@pytest.mark.slow  # the brute-force oracle over every kind tuple, share and split: minutes
def test_mixed_search_matches_brute_force():
    """Two types (the slow one 1.5-4x slower per node, its own memory), 2-12 devices: the search's
    plan is the optimum over every schedule, depth, micro-batch count, placement, share and split."""
    num_instances = NUM_INSTANCES * 3 // 20  # 12 in make test, 30 in the full set
    ratios = np.array(_check_against_oracle(range(num_instances)))
    assert len(ratios) >= num_instances * 5 // 6
    assert ratios.min() >= 1 - 1e-9
    assert ratios.max() <= 1.01, (np.argmax(ratios), ratios.max())


def test_mixed_instances_use_unequal_shares_and_both_types():
    """The oracle instances exercise what the mixed search adds: some optimum splits a stage's
    micro-batch unequally, and some optimum runs on both device types."""
    plans = [best_mixed(mixed_instance(seed))[0] for seed in QUICK_SEEDS]
    assert any(s.replica_samples is not None for p in plans if p for s in p.stages)
    assert any(len({p.cluster.group_of_rank(r) for s in p.stages for r in s.ranks}) == 2 for p in plans if p)


def test_plan_on_a_mixed_cluster_with_its_baselines(mlp_graph):
    cluster = Cluster(groups=[DeviceGroup("h100", 2, 8), DeviceGroup("v100-32gb", 2, 8)])
    result = plan_with_baselines(mlp_graph, cluster=cluster, global_batch_size=16)
    names = list(result.baselines)
    assert names == [f"{FASTEST_ONLY} (h100)", f"{SLOWEST_EVERYWHERE} (v100-32gb)"]
    assert all(p is not None for p in result.baselines.values())
    assert result.plan.predicted_step_s <= min(p.predicted_step_s for p in result.baselines.values())
    fastest = result.baselines[names[0]]
    # the h100 group holds the cluster's first ranks: the baseline is recast onto the mixed cluster
    assert {fastest.cluster.group_of_rank(r) for s in fastest.stages for r in s.ranks} == {0}
    assert result.baselines[names[1]].cluster == cluster  # simulated on the real cluster
    p = partita.plan(mlp_graph, cluster=cluster, global_batch_size=16)
    assert p.to_json() == result.plan.to_json()
    again = plan_from_json(p.to_json())
    assert again == p and again.to_json() == p.to_json()


# (activation scale, seed): instances whose activations outgrow memory, where the least level
# that fits is selective for some stages and full for others (the rest keep everything)
ACTIVATION_HEAVY = ((20, 9), (60, 9), (150, 7), (150, 16), (60, 3), (150, 5))


def test_recomputation_levels_match_brute_force_on_activation_heavy_instances():
    """Per stage the least of none, selective and full at which all its replicas fit, as the
    brute force over every layout chooses it (mixed_instances.mixed_oracle)."""
    from partita.types import Recompute

    levels = set()
    for scale, seed in ACTIVATION_HEAVY:
        run = mixed_instance(seed, activation_scale=scale)
        found, _ = best_mixed(run)
        best = mixed_oracle(run)
        assert found is not None and best is not None, (scale, seed)
        assert found.predicted_step_s <= best.predicted_step_s * 1.01, (scale, seed)
        check_layout(found)
        levels |= {s.recompute for s in found.stages}
    assert levels == {Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL}


def test_selective_recomputation_pinned_on_a_mixed_cluster(gpt2_graph):
    """A pinned level holds on every stage of a mixed plan (it was refused before), and costs its
    recomputed time: each stage's backward is the plain backward plus its selective seconds."""
    from partita.types import Recompute

    cluster = Cluster(groups=[DeviceGroup("h100", 2, 8), DeviceGroup("a100-40gb", 2, 8)])
    options = partita.PlanOptions(recompute="selective", num_stages=2, schedules="1f1b")
    pinned = partita.plan(gpt2_graph, cluster=cluster, global_batch_size=16, options=options)
    assert pinned.cluster.is_mixed and [s.recompute for s in pinned.stages] == [Recompute.SELECTIVE] * 2
    check_layout(pinned)
    kept = partita.plan(
        gpt2_graph, cluster=cluster, global_batch_size=16, options=dataclasses.replace(options, recompute="none")
    )
    compared = 0
    for a, b in zip(pinned.stages, kept.stages):
        if (a.start, a.stop, a.ranks, a.replica_samples) == (b.start, b.stop, b.ranks, b.replica_samples):
            assert a.backward_s > b.backward_s
            # a stage of the head alone (no whole block) keeps its input besides the tensors it
            # rebuilds: selective recomputation saves memory on stages that hold blocks
            assert a.memory_bytes < b.memory_bytes or not a.blocks
            compared += bool(a.blocks)
    assert compared, (pinned.summary(), kept.summary())


def test_unequal_shares_follow_the_speeds():
    """Replicas of one stage on both types: the faster type's replicas take more samples."""
    for seed in QUICK_SEEDS:
        p = best_mixed(mixed_instance(seed))[0]
        for stage in p.stages if p else ():
            if stage.replica_samples is None:
                continue
            groups = [p.cluster.group_of_rank(stage.replica_ranks(j)[0]) for j in range(stage.num_replicas)]
            fast = [n for n, g in zip(stage.replica_samples, groups) if g == 0]
            slow = [n for n, g in zip(stage.replica_samples, groups) if g == 1]
            if fast and slow:
                assert min(fast) >= max(slow), (seed, stage.replica_samples)


def test_cli_prints_both_baselines_and_the_idle_types(capsys, tmp_path):
    png = tmp_path / "p.png"
    flags = [
        "--global-batch",
        "16",
        "--tensor-parallel",
        "1",
        "--png",
        str(png),
    ]  # degree 1 pinned (the mixed search weighs every degree that tiles both groups otherwise)
    assert main(["plan", "mlp", "--devices", "2xh100,2xv100-32gb", *flags]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # simulated with each rank at its type's speed
    text = capsys.readouterr().out
    assert "fastest type only (h100)" in text and "slowest type everywhere (v100-32gb)" in text
    # a tiny MLP runs fastest on the two H100s: the note names the idle devices by type
    assert "note: the plan uses 2 of 4 devices" in text
    assert "idle devices: 2 x v100-32gb" in text


@pytest.mark.slow  # the whole mixed search space of a small cluster (about 30 s)
def test_a_group_smaller_than_a_node_beside_a_full_node(mlp_graph):
    """4 H100s beside 8 V100s (12 devices, nodes of 8): the slowest-everywhere baseline plans 12
    V100s in nodes of 4 (nodes must divide the total), and the plan is one of the three."""
    cluster = Cluster(groups=[DeviceGroup("h100", 4, 8), DeviceGroup("v100-32gb", 8, 8)])
    result = plan_with_baselines(mlp_graph, cluster=cluster, global_batch_size=8)
    assert all(p is not None for p in result.baselines.values()), result.baseline_reasons
    assert result.plan.predicted_step_s <= min(p.predicted_step_s for p in result.baselines.values())


# GPT-2 tiny (149k parameters: 2.4 MB with AdamW's states) on devices of 1.5-3 MB: a pipeline of
# tensor-parallel groups, one stage per device type, or (3 MB) the H100s alone
TENSOR_PARALLEL_INSTANCES = ((2, 1_500_000), (2, 3_000_000), (4, 1_500_000))


def _tiny_memory_run(graph, per_group: int, memory: int):
    from partita.planning.device_groups import mixed_run

    groups = [DeviceGroup(d, per_group, per_group, memory_bytes=memory) for d in ("h100", "a100-40gb")]
    cluster = Cluster(groups=groups, reserved_memory_fraction=0.0)
    options = partita.PlanOptions(costs="analytic", max_blocks=6)
    return mixed_run(graph, cluster=cluster, global_batch_size=8, options=options)


def test_tensor_parallel_mixed_search_matches_brute_force(gpt2_graph):
    """At each degree above 1 that tiles both groups, a replica is a group of that many devices of one
    type: the search's plan against the brute force over every layout of such groups."""
    from partita.planning.device_groups import degree_runs

    seen = set()
    for per_group, memory in TENSOR_PARALLEL_INSTANCES:
        runs = degree_runs(_tiny_memory_run(gpt2_graph, per_group, memory))
        assert [r.tensor_parallel for r in runs] == [1, 2, 4][: 1 + per_group // 2]
        for run in runs[1:]:
            found, _ = best_mixed(run)
            best = mixed_oracle(run)
            assert found is not None and best is not None, (per_group, memory, run.tensor_parallel)
            assert found.predicted_step_s == pytest.approx(best.predicted_step_s, rel=1e-9)
            assert found.tensor_parallel == run.tensor_parallel and found.sequence_parallel
            check_layout(found)
            for stage in found.stages:  # each replica: t consecutive ranks of one device type and node
                for j in range(stage.num_replicas):
                    ranks = stage.replica_ranks(j)
                    assert len({found.cluster.rank_to_node(r) for r in ranks}) == 1
                    assert ranks == tuple(range(ranks[0], ranks[0] + run.tensor_parallel))
            seen.add(len({found.cluster.group_of_rank(r) for s in found.stages for r in s.ranks}))
    assert seen == {1, 2}  # plans on the H100s alone and over both types


def test_per_type_degrees_match_brute_force(gpt2_graph):
    """Each device type at a degree of its own (next to the best common degree): a stage runs on one
    type, its replicas groups of that type's degree; the search's plan against the brute force over
    every such layout, and the runtime runs it (one degree per stage, consecutive ranks per group)."""
    from partita.planning.device_groups import per_type_degree_runs

    seen = set()
    for per_group, memory in TENSOR_PARALLEL_INSTANCES[:2]:
        runs = per_type_degree_runs(_tiny_memory_run(gpt2_graph, per_group, memory), 2)
        assert sorted(r.degrees for r in runs) == [(1, 2), (2, 1)]
        for run in runs:
            found, _ = best_mixed(run)
            best = mixed_oracle(run)
            assert (found is None) == (best is None), (per_group, memory, run.degrees)
            if found is None:
                continue
            assert found.predicted_step_s == pytest.approx(best.predicted_step_s, rel=1e-9)
            check_layout(found)
            assert plan_from_json(found.to_json()) == found
            for stage in found.stages:
                (group,) = {found.cluster.group_of_rank(r) for r in stage.ranks}
                assert stage.tensor_parallel == run.degrees[group]
                assert stage.sequence_parallel == (stage.tensor_parallel > 1)
                for j in range(stage.num_replicas):
                    ranks = stage.replica_ranks(j)
                    assert ranks == tuple(range(ranks[0], ranks[0] + stage.tensor_parallel))
            seen.add(found.uniform_tensor_parallel)
    assert False in seen  # some plan runs its stages at different degrees


def test_per_type_degrees_are_searched_next_to_the_best_and_never_when_pinned(gpt2_graph):
    from partita.planning.device_groups import per_type_degree_runs

    run = _tiny_memory_run(gpt2_graph, 4, 3_000_000)
    assert sorted(r.degrees for r in per_type_degree_runs(run, 2)) == [(1, 2), (2, 1), (2, 4), (4, 2)]
    assert sorted(r.degrees for r in per_type_degree_runs(run, 4)) == [(2, 4), (4, 2)]
    pinned = dataclasses.replace(run, options=run.options.replace(tensor_parallel=2))
    assert per_type_degree_runs(pinned, 2) == []


def test_partita_plan_searches_tensor_parallel_degrees_on_a_mixed_cluster(gpt2_graph):
    """``partita.plan`` on a mixed cluster weighs the mixed search at each degree; a pinned degree holds
    for every stage of the mixed plan and both baselines (the free plan, which may give each type its
    own degree, is at least as fast), and one that cannot tile a device group is refused by name for
    the mixed search (a baseline may still plan it)."""
    from partita.errors import InputError
    from partita.planning.device_groups import degree_runs, mixed_run

    run = _tiny_memory_run(gpt2_graph, 2, 1_500_000)
    result = plan_with_baselines(run.graph, cluster=run.cluster, global_batch_size=8, options=run.options)
    assert result.plan.method == "partita" and result.plan.tensor_parallel == 2, result.plan
    check_layout(result.plan)
    assert result.plan.predicted_step_s <= min(p.predicted_step_s for p in result.baselines.values() if p)
    pinned = run.options.replace(tensor_parallel=2)
    again = plan_with_baselines(run.graph, cluster=run.cluster, global_batch_size=8, options=pinned)
    assert all(s.tensor_parallel == 2 for s in again.plan.stages), again.plan
    assert result.plan.predicted_step_s <= again.plan.predicted_step_s
    assert all(p.tensor_parallel == 2 for p in again.baselines.values() if p is not None)
    # a pinned degree that cannot tile the A100s: the mixed search is refused by name, the H100s plan alone
    uneven = Cluster(groups=[DeviceGroup("h100", 4, 4), DeviceGroup("a100-40gb", 2, 2)])
    with pytest.raises(InputError, match=r"device group 1 \(2 x a100-40gb\): tensor_parallel=4 exceeds"):
        degree_runs(
            mixed_run(run.graph, cluster=uneven, global_batch_size=8, options=run.options.replace(tensor_parallel=4))
        )
    alone = partita.plan(run.graph, cluster=uneven, global_batch_size=8, options=run.options.replace(tensor_parallel=4))
    assert alone.tensor_parallel == 4 and {uneven.group_of_rank(r) for s in alone.stages for r in s.ranks} == {0}


def test_a_pinned_sharding_level_is_honoured_on_a_mixed_cluster():
    """GPT-2 (tied embedding and LM head) on 2 H100s beside 2 A100s with full_shard pinned: before,
    the mixed search's plan replicated every stage (the tied stages replicate under any level) and
    the pin was silently dropped; now the best plan that shards a stage wins."""
    from partita import examples

    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = Cluster(
        groups=(
            DeviceGroup(device="h100", num_devices=2, devices_per_node=2),
            DeviceGroup(device="a100-80gb", num_devices=2, devices_per_node=2),
        )
    )
    for pins in ({}, {"num_stages": 2}):
        options = partita.PlanOptions(costs="analytic", sharding="full_shard", **pins)
        plan = partita.plan(graph, cluster=cluster, global_batch_size=16, options=options)
        assert any(s.sharding.value == "full_shard" for s in plan.stages), (pins, plan.summary())

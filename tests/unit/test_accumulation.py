"""Gradient accumulation of sharded stages (``Accumulation``): whole gradients until the step's last
backward, or reduce-scattered in every backward and summed into the shards. The memory model, the
time model, the planner's choice between the two, manual plans, plan files and the digest."""

from __future__ import annotations

import json

import numpy as np
import pytest

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.cost.memory import device_memory
from partita.cost.segment_memory import segment_totals
from partita.errors import InputError, PlanFileError
from partita.planning.options import PlanOptions
from partita.planning.sharding import accumulations, step_overhead_s
from partita.runtime.plan_digest import plan_digest
from partita.types import Accumulation, OptimizerKind, Precision, Sharding
from partita.types.cluster import Cluster
from partita.types.plan_file import plan_from_json, plan_to_dict


@pytest.fixture(scope="module")
def gpt2_graph():
    ex = examples.build("gpt2", batch_size=8, seq_len=32)
    return partita.capture(ex.model, ex.args, ex.kwargs)


@pytest.mark.parametrize("level", [Sharding.SHARD_GRADS_AND_OPTIMIZER, Sharding.FULL_SHARD])
def test_sharded_accumulation_holds_a_share_of_the_gradients_and_the_unit_in_backward(level, gpt2_graph):
    costs = analytic_costs(gpt2_graph, "h100", 4)
    n = gpt2_graph.num_nodes
    kw = dict(in_flight=2, optimizer=OptimizerKind.ADAM, sharding=level, num_replicas=4, num_microbatches=4)
    whole = device_memory(costs, [(0, n)], **kw)
    sharded = device_memory(costs, [(0, n)], accumulation=Accumulation.SHARDED, **kw)
    trainable = whole.grad_bytes
    units = segment_totals(costs, 0, n, trainable)
    largest_unit = max(float(units.root), float(units.largest_unit))
    assert sharded.grad_bytes == int(np.ceil(trainable / 4) + largest_unit) < trainable
    assert sharded.total_bytes < whole.total_bytes
    assert sharded.step_grad_bytes == whole.step_grad_bytes == int(np.ceil(trainable / 4))  # the shard
    # a stage without a whole block is one unit: all of its gradients are whole in its backward
    one_unit = device_memory(costs, [(0, 3)], accumulation=Accumulation.SHARDED, **kw)
    assert one_unit.grad_bytes == device_memory(costs, [(0, 3)], **kw).grad_bytes


def test_accumulation_is_a_choice_of_sharded_stages_with_several_micro_batches():
    assert accumulations(Sharding.REPLICATE, 4, 8) == (Accumulation.WHOLE,)
    assert accumulations(Sharding.FULL_SHARD, 1, 8) == (Accumulation.WHOLE,)
    assert accumulations(Sharding.FULL_SHARD, 4, 1) == (Accumulation.WHOLE,)
    assert accumulations(Sharding.FULL_SHARD, 4, 8) == (Accumulation.WHOLE, Accumulation.SHARDED)


def test_sharded_accumulation_reduce_scatters_every_micro_batch():
    kw = dict(
        trainable_bytes=1e9,
        forward_s=0.01,
        backward_s=0.02,
        num_microbatches=8,
        num_replicas=8,
        precision=Precision.BF16,
        optimizer=OptimizerKind.ADAM,
        cluster=Cluster(device="h100", num_devices=8),
        spans_nodes=False,
    )
    once = step_overhead_s(Sharding.FULL_SHARD, **kw)
    every = step_overhead_s(Sharding.FULL_SHARD, accumulation=Accumulation.SHARDED, **kw)
    alone = step_overhead_s(Sharding.FULL_SHARD, **{**kw, "num_microbatches": 1})
    every_alone = step_overhead_s(
        Sharding.FULL_SHARD, accumulation=Accumulation.SHARDED, **{**kw, "num_microbatches": 1}
    )
    assert every_alone == pytest.approx(alone)  # one micro-batch: one reduce-scatter either way
    # the gathers grow with the micro-batches alike; sharded adds one reduce-scatter per micro-batch
    two = {**kw, "num_microbatches": 2}
    one_more = step_overhead_s(Sharding.FULL_SHARD, accumulation=Accumulation.SHARDED, **two)
    one_more -= step_overhead_s(Sharding.FULL_SHARD, **two)
    assert one_more > 0 and every - once == pytest.approx(7 * one_more)


def _plan(graph, limit_bytes=None):
    """One 1F1B stage of two fully sharded replicas, four micro-batches (a backward runs before the
    activation peak: every gradient is alive at it); ``limit_bytes``: the memory the planner may fill."""
    memory = {} if limit_bytes is None else dict(memory_bytes=limit_bytes, reserved_memory_fraction=0.0)
    options = PlanOptions(
        costs="analytic",
        schedules="1f1b",
        num_stages=1,
        replicas=2,
        num_microbatches=4,
        sharding="full_shard",
        recompute="none",
        precision="fp32",
    )
    return partita.plan(
        graph, cluster=Cluster(device="h100", num_devices=2, **memory), global_batch_size=16, options=options
    )


def test_the_planner_shards_the_accumulation_only_where_whole_gradients_do_not_fit(gpt2_graph):
    roomy = _plan(gpt2_graph)
    stage = roomy.stages[0]
    assert stage.accumulation is Accumulation.WHOLE  # it moves less
    costs = analytic_costs(gpt2_graph, "h100", 2)  # 16 samples: 4 micro-batches of 2 per replica
    kw = dict(
        in_flight=1, optimizer=OptimizerKind.ADAM, sharding=Sharding.FULL_SHARD, num_replicas=2, num_microbatches=4
    )
    whole = device_memory(costs, [(0, gpt2_graph.num_nodes)], **kw)
    sharded = device_memory(costs, [(0, gpt2_graph.num_nodes)], accumulation=Accumulation.SHARDED, **kw)
    assert stage.memory_bytes == whole.total_bytes > sharded.total_bytes
    squeezed = _plan(gpt2_graph, limit_bytes=(whole.total_bytes + sharded.total_bytes) // 2)
    assert squeezed.stages[0].accumulation is Accumulation.SHARDED, squeezed.summary()
    assert squeezed.stages[0].memory_bytes == sharded.total_bytes
    assert squeezed.predicted_step_s > roomy.predicted_step_s  # 4 reduce-scatters in place of 1
    assert "grads sharded" in squeezed.summary()


def test_manual_plans_plan_files_and_the_digest_carry_the_accumulation(gpt2_graph):
    n = gpt2_graph.num_nodes
    kw = dict(schedule="gpipe", num_rank_groups=1, replicas=2, num_microbatches=2, global_batch_size=8)
    whole = partita.manual_plan(gpt2_graph, [0, n], sharding="full_shard", **kw)
    sharded = partita.manual_plan(gpt2_graph, [0, n], sharding="full_shard", accumulation="sharded", **kw)
    assert whole.stages[0].accumulation is Accumulation.WHOLE
    assert sharded.stages[0].accumulation is Accumulation.SHARDED
    assert sharded.stages[0].blocks == 2  # GPT-2's two layers, each its own FSDP2 unit
    assert plan_digest(whole) != plan_digest(sharded)  # the runtime runs them differently
    data = plan_to_dict(sharded)
    assert data["stages"][0]["accumulation"] == "sharded"
    assert "accumulation" not in plan_to_dict(whole)["stages"][0]  # older readers see the files they know
    assert plan_from_json(json.dumps(data)).stages[0].accumulation is Accumulation.SHARDED
    with pytest.raises(InputError, match="no stage is sharded"):
        partita.manual_plan(gpt2_graph, [0, n], accumulation="sharded", **kw)
    replicated = plan_to_dict(partita.manual_plan(gpt2_graph, [0, n], **kw))
    replicated["stages"][0]["accumulation"] = "sharded"
    with pytest.raises(PlanFileError, match=r"stages\[0\].accumulation is 'sharded', but the stage is not sharded"):
        plan_from_json(json.dumps(replicated))
    data["stages"][0]["accumulation"] = "halfway"
    with pytest.raises(PlanFileError, match="accumulation"):
        plan_from_json(json.dumps(data))

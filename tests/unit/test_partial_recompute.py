"""Recomputing some of a stage's blocks (``StagePlan.recompute_blocks``, Megatron's "recompute N
layers"): which segments the runtime checkpoints, what the memory model counts, the planner's
choice of the fewest blocks that fit, and what manual plans and plan files accept. Exact training
with it: tests/dist/test_exact_losses.py."""

from __future__ import annotations

import json

import pytest
import torch

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.cost.memory import device_memory
from partita.errors import InputError, PlanFileError
from partita.planning.options import PlanOptions
from partita.runtime.pipeline import _SELECTIVE_CONTEXTS
from partita.runtime.segments import check_recompute_blocks, segment_stage
from partita.runtime.stages import flatten_inputs, split_graph
from partita.types import OptimizerKind, Recompute
from partita.types.cluster import Cluster
from partita.types.plan_file import plan_from_json, plan_to_dict

MiB = 2**20


@pytest.fixture(scope="module")
def gpt2_small():
    ex = examples.build("gpt2-small", batch_size=8, seq_len=128)  # 8 layers
    return ex, partita.capture(ex.model, ex.args, ex.kwargs)


@pytest.mark.parametrize("level", [Recompute.FULL, Recompute.SELECTIVE])
def test_only_the_first_blocks_segments_are_checkpointed_and_the_gradients_are_the_same(gpt2_small, level):
    ex, graph = gpt2_small
    flat = flatten_inputs(graph, ex.args, ex.kwargs)
    (stage,) = split_graph(graph, [0, graph.num_nodes])
    split = segment_stage(stage, graph)
    blocks = [k for k, s in enumerate(split.segments) if s.block is not None]
    assert len(blocks) == 8 and split.recomputed(level, 3) == frozenset(blocks[:3])
    assert split.recomputed(level, None) == frozenset(range(split.num_segments))
    assert split.recomputed(Recompute.NONE, 3) == frozenset()
    with pytest.raises(InputError, match="holds 8 whole block"):
        split.recomputed(level, 9)

    def grads(recompute_blocks):
        ex.model.zero_grad()
        loss = split.run(
            stage.state_tensors,
            stage.graph_inputs(flat),
            recompute=level,
            recompute_blocks=recompute_blocks,
            context_fn=_SELECTIVE_CONTEXTS,
        )
        loss.backward()
        return {k: p.grad.clone() for k, p in ex.model.named_parameters()}

    every, some = grads(None), grads(3)
    for name, grad in some.items():
        assert torch.equal(grad, every[name]), name


def test_the_memory_model_keeps_more_as_fewer_blocks_recompute(gpt2_small):
    _, graph = gpt2_small
    costs, n = analytic_costs(graph, "cpu", 8), graph.num_nodes
    kw = dict(in_flight=1, optimizer=OptimizerKind.ADAM, num_microbatches=1)
    nothing = device_memory(costs, [(0, n)], **kw).total_bytes
    for level in (Recompute.FULL, Recompute.SELECTIVE):
        every = device_memory(costs, [(0, n)], recompute=level, **kw).total_bytes
        some = [
            device_memory(costs, [(0, n)], recompute=level, recompute_blocks=k, **kw).total_bytes for k in (1, 4, 7)
        ]
        assert nothing > some[0] > some[1] > some[2], (nothing, some)
        assert some[2] >= every * 0.95  # 7 of 8 blocks: about the same as every segment
    # full recomputation of one block frees that block's activations but its input
    one = device_memory(costs, [(0, n)], recompute=Recompute.FULL, recompute_blocks=1, **kw).total_bytes
    two = device_memory(costs, [(0, n)], recompute=Recompute.FULL, recompute_blocks=2, **kw).total_bytes
    assert one - two == pytest.approx(nothing - one, rel=0.25)  # blocks of equal size: equal steps


def _plan(graph, memory_mib):
    options = PlanOptions(
        costs="analytic", schedules="1f1b", num_stages=1, replicas=1, num_microbatches=1, precision="fp32"
    )
    cluster = Cluster(device="h100", num_devices=1, memory_bytes=memory_mib * MiB, reserved_memory_fraction=0.0)
    return partita.plan(graph, cluster=cluster, global_batch_size=8, options=options)


def test_the_planner_recomputes_the_fewest_blocks_that_fit(gpt2_small):
    _, graph = gpt2_small
    roomy, some, every = (_plan(graph, mib) for mib in (2000, 300, 220))
    assert roomy.stages[0].recompute is Recompute.NONE and roomy.stages[0].recompute_blocks is None
    stage = some.stages[0]
    assert stage.recompute is not Recompute.NONE and 1 <= stage.recompute_blocks < 8, some.summary()
    assert stage.memory_bytes <= 300 * MiB
    assert f"({stage.recompute_blocks} of 8 blocks)" in some.summary()
    assert every.stages[0].recompute is Recompute.FULL and every.stages[0].recompute_blocks is None
    # fewer blocks recomputed: less backward than recomputing all, more than none
    assert roomy.predicted_step_s < some.predicted_step_s < every.predicted_step_s
    data = plan_to_dict(some)
    assert data["stages"][0]["recompute_blocks"] == stage.recompute_blocks
    assert plan_from_json(json.dumps(data)).stages[0].recompute_blocks == stage.recompute_blocks
    data["stages"][0]["recompute"] = "none"
    with pytest.raises(PlanFileError, match="recompute_blocks is .*, but its recompute is 'none'"):
        plan_from_json(json.dumps(data))
    data["stages"][0]["recompute_blocks"] = 0
    with pytest.raises(PlanFileError, match="recompute_blocks is 0"):
        plan_from_json(json.dumps(data))


def test_manual_plans_take_recompute_blocks_up_to_the_blocks_a_stage_holds(gpt2_small):
    _, graph = gpt2_small
    n = graph.num_nodes
    kw = dict(schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=8, recompute="full")
    plan = partita.manual_plan(graph, [0, n], recompute_blocks=3, **kw)
    assert plan.stages[0].recompute_blocks == 3 and plan.stages[0].blocks == 8
    assert (
        partita.manual_plan(graph, [0, n], recompute_blocks=3, **{**kw, "recompute": "none"}).stages[0].recompute_blocks
        is None
    )
    for wrong in (0, 9, 2.5):
        with pytest.raises(InputError, match="holds 8 whole block"):
            partita.manual_plan(graph, [0, n], recompute_blocks=wrong, **kw)


def test_a_plan_recomputing_more_blocks_than_a_stage_holds_is_refused_before_training(gpt2_small):
    import dataclasses

    _, graph = gpt2_small
    n = graph.num_nodes
    kw = dict(schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=8, recompute="full")
    stage = partita.manual_plan(graph, [0, n], recompute_blocks=8, **kw).stages[0]
    check_recompute_blocks(stage, graph)  # all 8: fine
    edited = dataclasses.replace(stage, recompute_blocks=9)  # as an edited plan file may say
    with pytest.raises(InputError, match="stage 0 has recompute_blocks=9, but it holds 8 whole block"):
        check_recompute_blocks(edited, graph)


def test_a_pinned_recomputation_level_recomputes_every_block(gpt2_small):
    """Megatron's layouts pin full recomputation of every layer: the pin is honoured."""
    _, graph = gpt2_small
    options = PlanOptions(
        costs="analytic", schedules="1f1b", num_stages=1, replicas=1, num_microbatches=1, precision="fp32",
        recompute="full",
    )  # fmt: skip
    cluster = Cluster(device="h100", num_devices=1, memory_bytes=300 * MiB, reserved_memory_fraction=0.0)
    plan = partita.plan(graph, cluster=cluster, global_batch_size=8, options=options)
    assert plan.stages[0].recompute is Recompute.FULL and plan.stages[0].recompute_blocks is None

"""Tensor parallelism on the planning side: per-device costs, the degree search, plans, files, CLI.

Layouts are made by hand here (the MLP matmuls of a graph split Megatron-style), so that these
tests check the planner whatever the capture rules find; the CNN test uses the rules themselves.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from clusters import h100s
from torch import nn

import partita
from partita import examples
from partita.cli.main import _plan_options
from partita.cli.parser import build_parser
from partita.cost import comm
from partita.cost.analytic import analytic_costs
from partita.cost.tensor_parallel import tensor_parallel_costs
from partita.errors import InputError, PlanFileError
from partita.planning import tensor_parallel as tp
from partita.planning.api import plan_with_baselines
from partita.planning.manual import manual_plan
from partita.planning.options import PlanOptions
from partita.planning.simulate import simulate
from partita.types import Precision, Sharding
from partita.types.plan_file import plan_from_json, plan_to_dict
from partita.types.tensor_parallel import ParamShard, TensorParallelLayout


def split_layout(graph, degree, pairs):
    """Each (column, row) pair of matmul nodes split Megatron-style: the nodes from the column-
    parallel one to the row-parallel one are split, the row-parallel output is all-reduced in the
    forward and the column-parallel input's gradient in the backward."""
    params, split, forward, backward = {}, set(), {}, {}
    for column, row in pairs:
        first, last = graph.node(column), graph.node(row)
        for name in first.params:  # the dims are GPT-2's Conv1D's (the planner reads only the names)
            params[name] = ParamShard(0 if name.endswith("bias") else 1)
        params[next(p for p in last.params if not p.endswith("bias"))] = ParamShard(0)
        split |= {n.name for n in graph.nodes[first.index : last.index + 1]}
        forward[row] = math.prod(last.outputs[0].shape)
        read = graph.nodes[first.inputs[0]].outputs[0] if first.inputs else graph.inputs[first.graph_inputs[0]].tensor
        backward[column] = math.prod(read.shape)
    return TensorParallelLayout(degree, params, frozenset(split), forward, backward)


def gpt2_mlp_pairs(graph):
    """(c_fc, c_proj) addmm nodes of every GPT-2 block."""
    fc = [n.name for n in graph.nodes if n.module_path.endswith("mlp.c_fc") and "addmm" in n.target]
    proj = [n.name for n in graph.nodes if n.module_path.endswith("mlp.c_proj") and "addmm" in n.target]
    return list(zip(fc, proj))


@pytest.fixture
def mlp_layouts(monkeypatch):
    """find_layout splits the matmul pairs of the graph (GPT-2's MLPs, WideMLP's blocks); no region by token."""

    def find(graph, degree, *, sequence_parallel=False):
        pairs = gpt2_mlp_pairs(graph) or wide_pairs(graph)
        return split_layout(graph, degree, pairs)

    monkeypatch.setattr(tp, "find_layout", find)


class WideMLP(nn.Module):
    """Residual blocks of two big matmuls on (B, T, W) tokens: compute-bound, easy to split."""

    def __init__(self, width: int = 4096, num_blocks: int = 2):
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(num_blocks))
        self.downs = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(num_blocks))

    def forward(self, x):  # (B, T, W) -> loss
        for up, down in zip(self.ups, self.downs):
            x = x + down(torch.nn.functional.gelu(up(x)))
        return x.square().mean()


def wide_pairs(graph):
    mms = [n.name for n in graph.nodes if "ups." in n.module_path or "downs." in n.module_path if n.params]
    return list(zip(mms[0::2], mms[1::2]))


@pytest.fixture(scope="module")
def wide():
    with torch.device("meta"):
        model = WideMLP()
        x = torch.randn(2, 2048, 4096)
    return partita.capture(model, (x,))


# ----------------------------------------------------------------------------- costs


def test_costs_of_one_device_divide_split_work_bytes_and_parameters(gpt2_graph):
    layout = split_layout(gpt2_graph, 2, gpt2_mlp_pairs(gpt2_graph))
    cluster = h100s(2)
    whole = analytic_costs(gpt2_graph, "h100", 4, precision="bf16")
    part = tensor_parallel_costs(whole, gpt2_graph, layout, cluster)
    assert part.tensor_parallel == 2 and whole.tensor_parallel == 1
    column, row = gpt2_mlp_pairs(gpt2_graph)[0]
    c, r = gpt2_graph.node(column).index, gpt2_graph.node(row).index
    # half the work; the row-parallel output is all-reduced after its forward (bf16, 4 of 8 samples)
    reduce_s = comm.allreduce_time_s(layout.forward_reductions[row] * 4 / 8 * 2, 2, cluster, spans_nodes=False)
    assert part.forward_s[r] == pytest.approx(whole.forward_s[r] / 2 + reduce_s)
    assert part.forward_s[c] == pytest.approx(whole.forward_s[c] / 2)
    assert part.backward_s[c] > whole.backward_s[c] / 2  # the input gradient's all-reduce
    assert part.backward_weight_s[c] == pytest.approx(whole.backward_weight_s[c] / 2)
    unsplit = [
        n.index
        for n in gpt2_graph.nodes
        if n.name not in layout.sharded_nodes and n.name not in layout.backward_reductions
    ]
    np.testing.assert_allclose(part.forward_s[unsplit], whole.forward_s[unsplit])
    assert part.output_bytes[c] == whole.output_bytes[c] // 2
    assert part.activation_bytes.sum() < whole.activation_bytes.sum()
    assert part.cut_bytes[c + 1] < whole.cut_bytes[c + 1]  # the split output crosses that cut as halves
    for k, name in enumerate(whole.param_names):
        expected = whole.param_bytes[k] // 2 if name in layout.params else whole.param_bytes[k]
        assert part.param_bytes[k] == expected
    assert tensor_parallel_costs(whole, gpt2_graph, TensorParallelLayout(2), cluster) is whole  # nothing splits


def test_measured_activation_bytes_scale_by_the_modelled_share(gpt2_graph):
    layout = split_layout(gpt2_graph, 2, gpt2_mlp_pairs(gpt2_graph))
    analytic = analytic_costs(gpt2_graph, "h100", 4)
    measured = dataclasses.replace(analytic, source="measured", activation_bytes=2 * analytic.activation_bytes)
    expected = tensor_parallel_costs(analytic, gpt2_graph, layout, h100s(2)).activation_bytes
    np.testing.assert_array_equal(
        tensor_parallel_costs(measured, gpt2_graph, layout, h100s(2)).activation_bytes, 2 * expected
    )


def test_a_layout_of_another_graph_is_refused(gpt2_graph):
    layout = TensorParallelLayout(2, {"nope.weight": ParamShard(0)}, frozenset({"no_such_node"}))
    costs = analytic_costs(gpt2_graph, "h100", 4)
    with pytest.raises(InputError, match="another graph"):
        tensor_parallel_costs(costs, gpt2_graph, layout, h100s(2))
    # the gradient of a graph input (the batch) is never computed: naming one costs nothing
    batch = TensorParallelLayout(2, {"transformer.wte.weight": ParamShard(0)}, backward_reductions={"input_ids": 99})
    np.testing.assert_array_equal(
        tensor_parallel_costs(costs, gpt2_graph, batch, h100s(2)).backward_s, costs.backward_s
    )


def test_stage_boundaries_stay_outside_split_regions(gpt2_graph):
    layout = split_layout(gpt2_graph, 2, gpt2_mlp_pairs(gpt2_graph))
    inside = tp.split_crossings(gpt2_graph, layout)
    column, row = gpt2_mlp_pairs(gpt2_graph)[0]
    assert inside[gpt2_graph.node(column).index + 1] and not inside[gpt2_graph.node(row).index + 1]
    assert not inside[0] and not inside[-1]


# ----------------------------------------------------------------------------- plans


def test_a_pinned_degree_gives_groups_of_consecutive_ranks_and_smaller_parameters(gpt2_graph, mlp_layouts):
    cluster = h100s(4)
    kw = dict(num_stages=1, replicas=1, num_microbatches=1, schedules="gpipe")
    one = partita.plan(gpt2_graph, cluster=cluster, global_batch_size=8, options=PlanOptions(tensor_parallel=1, **kw))
    two = partita.plan(gpt2_graph, cluster=cluster, global_batch_size=8, options=PlanOptions(tensor_parallel=2, **kw))
    assert one.tensor_parallel == 1 and one.stages[0].ranks == (0,)
    assert two.tensor_parallel == 2 and all(s.tensor_parallel == 2 for s in two.stages)
    assert two.stages[0].ranks == (0, 1) and two.stages[0].num_replicas == 1 and two.num_devices == 2
    split_bytes = sum(
        gpt2_graph.parameters[name].num_bytes for name in split_layout(gpt2_graph, 2, gpt2_mlp_pairs(gpt2_graph)).params
    )
    # bf16 on h100: fp32 parameters are their own master; half of every split one per device
    assert two.stages[0].param_bytes == one.stages[0].param_bytes - split_bytes // 2
    assert two.stages[0].memory_breakdown.params_bytes < one.stages[0].memory_breakdown.params_bytes
    assert two.stages[0].memory_bytes < one.stages[0].memory_bytes
    assert two.total_compute_s == pytest.approx(one.total_compute_s)  # the ideal step counts the whole graph


def test_replicas_of_a_tensor_parallel_stage_lie_replica_major(gpt2_graph, mlp_layouts):
    p = partita.plan(
        gpt2_graph,
        cluster=h100s(8),
        global_batch_size=16,
        options=PlanOptions(tensor_parallel=2, num_stages=2, replicas=2, schedules="1f1b"),
    )
    assert [s.ranks for s in p.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [s.replica_ranks(1) for s in p.stages] == [(2, 3), (6, 7)]
    assert all(s.num_replicas == 2 for s in p.stages) and p.num_devices == 8


def test_sharding_composes_with_tensor_parallelism(gpt2_graph, mlp_layouts):
    """Each tensor-parallel index shards its part of the state over the stage's replicas."""
    result = plan_with_baselines(
        gpt2_graph,
        cluster=h100s(4),
        global_batch_size=8,
        options=PlanOptions(
            tensor_parallel=2, replicas=2, num_stages=1, sharding="shard_grads_and_optimizer", precision="fp32"
        ),
    )
    stage = result.plan.stages[0]
    assert stage.sharding is Sharding.SHARD_GRADS_AND_OPTIMIZER and stage.num_replicas == 2
    table = result.context.costs_at(result.plan.microbatch_size)
    trainable = sum(int(b) for b, t in zip(table.param_bytes, table.param_trainable) if t)
    assert stage.memory_breakdown.optimizer_bytes == pytest.approx(3 * trainable / 2, abs=8)  # Adam + master, 1/r
    assert result.baselines["fsdp"] is None or result.baselines["fsdp"].tensor_parallel == 1  # plain FSDP2


def test_the_search_splits_big_matmuls_when_the_batch_cannot_be(wide, mlp_layouts):
    """Global batch 1 on 4 devices: no data parallelism, a pipeline of one micro-batch idles, and
    compute-bound matmuls split over 4 devices of a node run nearly 4x faster."""
    p = partita.plan(wide, cluster=h100s(4), global_batch_size=1)
    assert p.tensor_parallel > 1
    assert "tensor parallel" in p.summary()


def test_a_layout_that_splits_nothing_is_never_chosen(wide, monkeypatch):
    monkeypatch.setattr(tp, "find_layout", lambda graph, degree: TensorParallelLayout(degree))
    p = partita.plan(wide, cluster=h100s(4), global_batch_size=1)
    assert p.tensor_parallel == 1
    with pytest.raises(InputError, match="no parameter of this model splits"):
        partita.plan(wide, cluster=h100s(4), global_batch_size=1, options=PlanOptions(tensor_parallel=2))


def test_a_cnn_plans_without_tensor_parallelism():
    """The capture rules split at most its classifier head: too little to pay for the all-reduces."""
    ex = examples.build("cnn-tiny", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    assert not any(
        n.target.startswith("aten.conv") for n in graph.nodes if n.name in tp.find_layout(graph, 2).sharded_nodes
    )
    options = PlanOptions(uniform_replicas=True)
    assert partita.plan(graph, cluster=h100s(4), global_batch_size=4, options=options).tensor_parallel == 1


def test_the_simulated_step_includes_the_groups_all_reduces(gpt2_graph, mlp_layouts):
    result = plan_with_baselines(
        gpt2_graph, cluster=h100s(2), global_batch_size=8, options=PlanOptions(tensor_parallel=2, num_stages=1)
    )
    p, costs_at = result.plan, result.context.costs_at
    assert simulate(p, costs_at).step_s == pytest.approx(p.predicted_step_s)
    layout = result.context.layout
    silent = dataclasses.replace(layout, forward_reductions={}, backward_reductions={})
    base = result.context.unsharded.costs_at
    quiet = simulate(p, lambda b: tensor_parallel_costs(base(b), gpt2_graph, silent, p.cluster)).step_s
    assert quiet < p.predicted_step_s
    with pytest.raises(InputError, match="tensor-parallel degree 1"):
        simulate(p, base)  # the degree-1 costs are not this plan's


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(tensor_parallel=16), "exceeds devices_per_node=8"),
        (dict(tensor_parallel=3), "not a power of two"),
        (dict(tensor_parallel=4, cluster=h100s(6)), "does not divide the 6 devices"),
        (dict(tensor_parallel=4, cluster=h100s(12, devices_per_node=6)), "does not divide devices_per_node=6"),
        (dict(tensor_parallel=2, replicas=4), "replicas 4 x tensor_parallel 2 = 8 devices"),
        (dict(tensor_parallel=4, sharding="full_shard"), "one group"),
    ],
)
def test_degrees_the_cluster_cannot_hold_are_refused(gpt2_graph, kw, pattern):
    cluster = kw.pop("cluster", h100s(4))
    with pytest.raises(InputError, match=pattern):
        partita.plan(gpt2_graph, cluster=cluster, global_batch_size=8, options=PlanOptions(**kw))


def test_tensor_parallel_must_be_a_positive_int():
    with pytest.raises(InputError, match="tensor_parallel"):
        PlanOptions(tensor_parallel=0)


def test_searched_degrees_fit_the_nodes():
    assert tp.candidate_degrees(h100s(16)) == [1, 2, 4, 8]
    assert tp.candidate_degrees(h100s(6)) == [1, 2]
    assert tp.candidate_degrees(h100s(12, devices_per_node=6)) == [1, 2]
    assert tp.candidate_degrees(h100s(8), replicas=4, num_stages=2) == [1]
    grouped = tp.group_cluster(h100s(16), 4)
    assert (grouped.num_devices, grouped.devices_per_node) == (4, 2)


# ----------------------------------------------------------------------------- files, manual plans, CLI


def one_stage(graph, **kw):
    """A manual plan of the whole graph as one stage, one micro-batch of 8 samples."""
    return manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=8, **kw
    )


def test_plan_files_round_trip_the_degree(gpt2_graph, mlp_layouts):
    p = partita.plan(gpt2_graph, cluster=h100s(4), global_batch_size=8, options=PlanOptions(tensor_parallel=2))
    assert plan_from_json(p.to_json()) == p
    data = plan_to_dict(p)
    assert all(s["tensor_parallel"] == 2 for s in data["stages"])
    old = plan_to_dict(one_stage(gpt2_graph))
    for s in old["stages"]:
        del s["tensor_parallel"]  # files written before tensor parallelism
    assert plan_from_json(json.dumps(old)).tensor_parallel == 1


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda s: s.update(tensor_parallel=0), "expected an integer >= 1"),
        (lambda s: s.update(tensor_parallel=3), "do not split into tensor-parallel groups of 3"),
        (lambda s: s.update(ranks=[1, 2, 3, 0]), "not a tensor-parallel group of 2"),
    ],
)
def test_invalid_tensor_parallel_stages_in_a_plan_file(gpt2_graph, edit, pattern):
    data = plan_to_dict(one_stage(gpt2_graph, replicas=2, tensor_parallel=2))
    edit(data["stages"][0])
    with pytest.raises(PlanFileError, match=pattern):
        plan_from_json(json.dumps(data))


def test_manual_plans_take_a_degree(gpt2_graph):
    p = manual_plan(
        gpt2_graph,
        [0, 80, gpt2_graph.num_nodes],
        schedule="1f1b",
        num_rank_groups=2,
        num_microbatches=2,
        global_batch_size=8,
        replicas=2,
        tensor_parallel=2,
        sharding="full_shard",
    )
    assert [s.ranks for s in p.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert p.cluster.num_devices == 8 and p.tensor_parallel == 2 and p.stages[1].num_replicas == 2
    assert plan_from_json(p.to_json()) == p
    with pytest.raises(InputError, match="exceeds devices_per_node=2"):
        one_stage(gpt2_graph, tensor_parallel=4, cluster=h100s(4, devices_per_node=2))


def test_the_report_names_the_degree_and_each_replicas_group(gpt2_graph, mlp_layouts):
    result = plan_with_baselines(
        gpt2_graph,
        cluster=h100s(4),
        global_batch_size=8,
        options=PlanOptions(tensor_parallel=2, replicas=2, num_stages=1, schedules="gpipe"),
    )
    text = result.plan.summary(baselines=result.baselines)
    assert "1 rank group x 2 replicas x 2-way tensor parallel (4 devices)" in text
    assert "0-1,2-3" in text and "1x2 tp2" in text


@pytest.mark.parametrize("command", ["plan", "train"])
def test_the_cli_flag_pins_the_degree(command):
    argv = [command, "gpt2-tiny", "--tensor-parallel", "2"]
    if command == "plan":
        argv += ["--devices", "4", "--global-batch", "8"]
    args = build_parser().parse_args(argv)
    assert args.tensor_parallel == 2 and _plan_options(args).tensor_parallel == 2
    assert _plan_options(build_parser().parse_args(argv[:2] + argv[4:])).tensor_parallel is None


def test_precision_of_reductions_follows_the_plan(gpt2_graph):
    layout = split_layout(gpt2_graph, 2, gpt2_mlp_pairs(gpt2_graph))
    cluster = h100s(2)
    fp32 = tp_reduction(gpt2_graph, layout, cluster, Precision.FP32)
    bf16 = tp_reduction(gpt2_graph, layout, cluster, Precision.BF16)
    assert fp32 > bf16 > 0


def tp_reduction(graph, layout, cluster, precision):
    from partita.cost.tensor_parallel import reduction_times_s

    forward, backward = reduction_times_s(analytic_costs(graph, "h100", 8, precision=precision), graph, layout, cluster)
    return forward.sum() + backward.sum()

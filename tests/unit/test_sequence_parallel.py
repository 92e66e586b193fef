"""Sequence parallelism: the regions found on captured graphs (partita.capturing.sequence_parallel),
refused where tokens mix, its costs (activations divided, collectives counted), the planner's option
and the plan file. Numerics: tests/dist/test_recompute_sequence_parallel.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import partita
from partita import examples
from partita.capturing.sequence_parallel import find_sequence_layout
from partita.capturing.tensor_parallel import find_layout
from partita.cost.analytic import analytic_costs
from partita.cost.recompute import kept_mask
from partita.cost.table import value_bytes
from partita.cost.tensor_parallel import reduction_times_s, tensor_parallel_costs
from partita.errors import PlanFileError
from partita.planning.options import PlanOptions
from partita.types import Cluster

pytest.importorskip("transformers")


@functools.cache
def _graph(name: str):
    ex = examples.build(name, batch_size=2, seq_len=8)
    return partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_transformers_split_their_residual_streams_by_token(name):
    """Every row-parallel output and vocab-parallel embedding is reduce-scattered instead of
    all-reduced, the inputs of column-parallel matmuls are gathered, and the norms between are split."""
    graph = _graph(name)
    plain, tokens = find_layout(graph, 2), find_sequence_layout(graph, 2)
    assert tokens.sequence_parallel and not tokens.sequence_rejected, tokens.sequence_rejected
    norms = {n.name for n in graph.nodes if n.target in ("aten.layer_norm.default", "aten.rsqrt.default")}
    whole = {"bert": {"layer_norm_5"}}.get(name, set())  # after BERT's masked-LM transform, which runs whole
    assert norms - whole and norms - whole <= tokens.sequence_nodes and not whole & tokens.sequence_nodes
    sources = set(plain.forward_reductions) - {graph.nodes[graph.loss_node].name}  # rows and embeddings
    assert sources and not sources & set(tokens.forward_reductions)
    assert sources <= set(tokens.forward_passes) and tokens.gathered_nodes <= set(tokens.forward_passes)
    assert tokens.params == plain.params  # the same weights split


def test_gpt2_merged_token_dim_of_conv1d_is_split_by_its_sequence_factor():
    """GPT-2's Conv1D multiplies (B*T, H) rows: its region's split follows T (16 of them) through views."""
    graph = _graph("gpt2")
    tokens = find_sequence_layout(graph, 2)
    columns = set(tokens.fused_gathers.values())
    addmm = [
        n
        for n in graph.nodes
        if n.target == "aten.addmm.default" and n.name in tokens.forward_passes and n.name not in columns
    ]
    assert addmm and all(n.name in tokens.sequence_nodes for n in addmm)


@pytest.mark.parametrize(("name", "fused", "apart"), [("gpt2", 5, 0), ("llama", 1, 4)])
def test_a_column_parallel_matmul_alone_on_its_input_gathers_it_itself(name, fused, apart):
    """GPT-2's fused QKV projection, first MLP matmul and LM head each read their norm's output alone:
    each all-gathers it inside (``fused_gathers``), its collectives counted at the matmul (the forward's
    all-gather, and in backward the input gradient's reduce-scatter and the input gathered again),
    the value not kept whole. Llama's query, key and value projections (and its gate and up
    projections) share theirs: gathered once, apart; its LM head gathers its own."""
    graph = _graph(name)
    tokens = find_sequence_layout(graph, 2)
    assert len(tokens.fused_gathers) == fused
    shared = [v for v in tokens.gathered_nodes if any(c in tokens.sharded_nodes for c in _consumers(graph, v))]
    assert len(shared) == apart
    for value, matmul in tokens.fused_gathers.items():
        elements = math.prod(graph.node(value).outputs[0].shape)
        assert value not in tokens.gathered_nodes and value not in tokens.forward_passes
        assert tokens.forward_passes[matmul] == (elements,) and tokens.backward_passes[matmul] == (elements, elements)


def test_a_matmul_left_whole_runs_on_its_gathered_input():
    """BERT's masked-LM transform (a dense layer feeding a norm over its features) stays whole under
    tensor parallelism: the region before it ends there, its input gathered whole."""
    graph = _graph("bert")
    tokens = find_sequence_layout(graph, 2)
    dense = graph.node("linear_12")
    assert "linear_12" in find_layout(graph, 2).rejected and "linear_12" not in tokens.sequence_nodes
    source = graph.nodes[dense.inputs[0]].name
    assert source in tokens.sequence_nodes and source in tokens.gathered_nodes
    assert source in tokens.forward_passes  # its all-gather


def _consumers(graph, name: str) -> list[str]:
    return [graph.nodes[c].name for c in graph.node(name).consumers]


class _Mixer(nn.Module):
    """A residual MLP whose residual stream goes through a running sum over the tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.up, self.down, self.norm, self.head = nn.Linear(16, 64), nn.Linear(64, 16), nn.LayerNorm(16), None
        self.head = nn.Linear(16, 256, bias=False)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        h = torch.cumsum(h, dim=1)  # mixes tokens
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_a_region_that_mixes_tokens_is_refused_with_the_reason():
    ids = torch.randint(0, 256, (4, 8))
    graph = partita.capture(_Mixer(), (ids, ids))
    plain, tokens = find_layout(graph, 2), find_sequence_layout(graph, 2)
    assert plain.params and not tokens.sequence_nodes
    assert tokens.sequence_rejected and all("mixes tokens" in why for why in tokens.sequence_rejected.values())
    assert tokens.forward_reductions == plain.forward_reductions  # still all-reduced


def test_costs_divide_the_split_regions_and_count_their_collectives():
    graph = _graph("llama")
    cluster = Cluster(device="h100", num_devices=2)
    table = analytic_costs(graph, "h100", 2)
    plain = tensor_parallel_costs(table, graph, find_layout(graph, 2), cluster)
    tokens = tensor_parallel_costs(table, graph, find_sequence_layout(graph, 2), cluster)
    assert tokens.activation_bytes.sum() < plain.activation_bytes.sum()
    # a token-split value crosses a boundary as each device's tokens (to a stage of the same degree)
    np.testing.assert_array_equal(tokens.whole_cut_bytes, plain.cut_bytes)
    assert (tokens.cut_bytes <= plain.cut_bytes).all()
    first = int(np.flatnonzero(plain.cut_bytes)[0])  # just after the embedding: the residual stream alone
    assert tokens.cut_bytes[first] * 2 == plain.cut_bytes[first]
    norm = next(n.index for n in graph.nodes if n.target == "aten.rsqrt.default")
    assert tokens.forward_s[norm] < plain.forward_s[norm]  # half the tokens' work
    assert tokens.backward_s.sum() > 0 and np.isfinite(tokens.forward_s).all()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_norms_weight_gradients_are_summed_once_per_step_not_per_microbatch(name):
    """A norm's weight and bias, broadcast over the tokens of split values, get each device's tokens'
    part of their gradient, which the runtime sums over the group with the other gradients once per
    step (Megatron-LM's way): the cost model charges no per-micro-batch all-reduce for them, while
    the plain tensor-parallel layout has none to charge (its norms run whole)."""
    from partita.capturing.sequence_parallel import analyze_sequence, broadcast_only
    from partita.capturing.tensor_parallel import whole_graph_analysis

    graph = _graph(name)
    fx_graph = graph.graph_module.graph
    analysis = whole_graph_analysis(graph, 2)
    sequence = analyze_sequence(fx_graph, analysis, outputs=(graph.nodes[graph.loss_node].name,))
    weights = [n for n in fx_graph.nodes if n.op == "get_attr"]
    partial = {n.target for n in weights if n.name in broadcast_only(weights, sequence)}
    norms = {graph.attr_to_param[t] for t in partial}
    assert len(norms) >= 3 and all("norm" in p or ".ln_" in p for p in norms), sorted(norms)
    assert not find_sequence_layout(graph, 2).backward_fixed_reductions


def test_selective_recomputation_keeps_the_token_part_of_row_parallel_outputs():
    """The runtime fuses a row-parallel matmul with its reduce-scatter (``matmul_reduce_scatter``):
    what selective recomputation keeps of it is this device's tokens of the sum, and its
    collective is not run again; the column-parallel inputs' all-gathers are (their matmuls'
    backward reads the gathered copies, which the recomputation rebuilds)."""
    graph = _graph("llama")
    cluster = Cluster(device="h100", num_devices=2)
    table = analytic_costs(graph, "h100", 2)
    plain = find_layout(graph, 2)
    layout = find_sequence_layout(graph, 2)
    tokens = tensor_parallel_costs(table, graph, layout, cluster)
    forward, _ = reduction_times_s(table, graph, layout, cluster)
    kept, whole = kept_mask(graph), value_bytes(graph, 2)
    rows = [n.index for n in graph.nodes if n.name in plain.forward_reductions and kept[n.index]]
    gathers = [n.index for n in graph.nodes if n.name in layout.forward_passes and not kept[n.index]]
    assert rows and gathers
    for k in rows:  # the whole partial product: whole[k]
        assert tokens.saved_bytes[k] * 2 == whole[k], graph.nodes[k].name
        assert forward[k] > 0 and tokens.selective_recompute_s[k] == 0  # kept whole: nothing runs again
    for k in gathers:
        assert tokens.selective_recompute_s[k] >= forward[k] > 0


def test_fused_row_parallel_matmuls_add_the_overlapped_ring_the_others_their_whole_collectives(monkeypatch):
    """The row-parallel matmuls, fused with their reduce-scatters, add what ``fused_row_seconds`` says
    of their ring to forward and to the backward's input pass (blocks this small run whole unless
    every block counts as large enough); every other node its collectives whole."""
    import partita.cost.collective_matmul as collective_costs
    from partita.cost.collective_matmul import fused_column_seconds, fused_row_seconds
    from partita.cost.table import output_bytes
    from partita.types.devices import get_device

    graph = _graph("llama")
    cluster = Cluster(device="h100", num_devices=4)
    table = analytic_costs(graph, "h100", 2)
    layout = find_sequence_layout(graph, 4)
    whole = tensor_parallel_costs(table, graph, layout, cluster)
    monkeypatch.setattr(collective_costs, "RING_MIN_BLOCK_FLOPS", 0)
    monkeypatch.setattr(collective_costs, "RING_MIN_BLOCK_BYTES", 0)
    tokens = tensor_parallel_costs(table, graph, layout, cluster)
    forward, backward = reduction_times_s(table, graph, layout, cluster)
    rows = [n.index for n in graph.nodes if n.name in find_layout(graph, 4).forward_reductions]
    rows = [k for k in rows if kept_mask(graph)[k]]
    columns = [graph.node(m).index for m in layout.fused_gathers.values()]
    others = [n.index for n in graph.nodes if forward[n.index] > 0 and n.index not in rows + columns]
    assert rows and columns and others
    for k in rows:
        x = graph.nodes[k].inputs[0]
        alone = fused_row_seconds(
            forward_s=table.forward_s[k : k + 1] / 4,
            backward_s=table.backward_s[k : k + 1] / 4,
            backward_weight_s=table.backward_weight_s[k : k + 1] / 4,
            forward_ring_s=forward[k : k + 1],
            backward_ring_s=backward[k : k + 1],
            output_block_bytes=output_bytes(graph, 2)[k : k + 1] / 4,
            input_block_bytes=np.array([value_bytes(graph, 2)[x] / 4 / 4]),  # features split, then one block
            contiguous=np.array([False]),  # two sequences: a block's rows are not
            degree=4,
            device=get_device("h100"),
        )
        np.testing.assert_allclose(tokens.forward_s[k], table.forward_s[k] / 4 + alone.forward[0])
        np.testing.assert_allclose(tokens.backward_s[k], table.backward_s[k] / 4 + alone.backward[0])
        np.testing.assert_allclose(tokens.backward_weight_s[k], table.backward_weight_s[k] / 4)  # as unfused
        # at the default threshold these blocks run whole: the matmul, then the reduce-scatter
        np.testing.assert_allclose(whole.forward_s[k], table.forward_s[k] / 4 + forward[k])
        np.testing.assert_allclose(whole.backward_s[k], table.backward_s[k] / 4 + backward[k])
    for matmul in layout.fused_gathers.values():
        k = graph.node(matmul).index
        alone = fused_column_seconds(
            forward_s=table.forward_s[k : k + 1] / 4,
            backward_s=table.backward_s[k : k + 1] / 4,
            backward_weight_s=table.backward_weight_s[k : k + 1] / 4,
            forward_ring_s=forward[k : k + 1],
            backward_ring_s=backward[k : k + 1],
            output_block_bytes=output_bytes(graph, 2)[k : k + 1] / 16,  # its tokens of its features
            contiguous=np.array([False]),
            degree=4,
            device=get_device("h100"),
        )
        assert backward[k] == pytest.approx(2 * forward[k])  # the input gathered again, the reduce-scatter
        input_part = (table.backward_s[k] - table.backward_weight_s[k]) / 4
        weight_part = table.backward_weight_s[k] / 4
        # the gather waits beyond the input gradient's product, the reduce-scatter beyond the weight's
        gathering, scattering = max(0.0, forward[k] - input_part), max(0.0, forward[k] - weight_part)
        assert alone.backward[0] == pytest.approx(gathering + scattering)
        # apart (a zero-bubble schedule's input pass) nothing hides the reduce-scatter
        assert tokens.split_backward_s[k] == pytest.approx(min(forward[k], weight_part))
        assert tokens.split_backward_s[k] > 0
        assert whole.split_backward_s[k] == 0
        np.testing.assert_allclose(tokens.forward_s[k], table.forward_s[k] / 4 + alone.forward[0])
        np.testing.assert_allclose(whole.forward_s[k], table.forward_s[k] / 4 + forward[k])
        np.testing.assert_allclose(tokens.backward_s[k], table.backward_s[k] / 4 + alone.backward[0])
        # run whole, it kept the gathered input: the backward's reduce-scatter alone
        np.testing.assert_allclose(whole.backward_s[k], table.backward_s[k] / 4 + forward[k])
        assert tokens.selective_recompute_s[k] == table.selective_recompute_s[k] / 4  # kept: no collective again
        # run apart, the gather is recomputed
        assert whole.selective_recompute_s[k] == pytest.approx(table.selective_recompute_s[k] / 4 + forward[k])
    for k in others:
        np.testing.assert_allclose(tokens.forward_s[k], table.forward_s[k] / 4 + forward[k])
    assert tokens.split_backward_s[rows + others].sum() == 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_cost_model_finds_contiguous_token_blocks_where_the_runtime_does(name):
    """A fused matmul's token blocks are contiguous (read and written in place around the ring) where
    every dim before their tokens is 1: the cost model's rule on the graph's shapes and token splits
    agrees with the runtime's view (``partita.runtime.collective_matmul``) at every micro-batch size,
    and holds for one sequence per micro-batch (GPT-2's merged ``(B*T, C)`` rows and Llama's
    ``(B, T, C)`` alike), not for several."""
    import torch

    from partita.cost.tensor_parallel import _contiguous_blocks

    graph, degree = _graph(name), 2
    layout = find_sequence_layout(graph, degree)
    assert set(layout.fused_gathers.values()) <= set(layout.token_splits)
    assert len(layout.token_splits) > len(layout.fused_gathers)  # the row-parallel sources too
    for microbatch in (1, 3):
        model = _contiguous_blocks(graph, layout, microbatch)
        for name_, (dim, inner) in layout.token_splits.items():
            value = graph.node(name_).outputs[0]
            shape = [
                s * microbatch // graph.batch_size if d == value.batch_dim else s for d, s in enumerate(value.shape)
            ]
            view = torch.empty(shape, device="meta").unflatten(dim, (shape[dim] // inner, degree, -1))
            runtime = view.select(dim + 1, 1).is_contiguous()  # a rank's tokens (``_parts``)
            assert model[graph.node(name_).index] == runtime == (microbatch == 1), (name_, microbatch)


def test_a_fused_column_keeps_its_input_part_around_the_ring_and_the_runtime_sizes_its_blocks_alike(monkeypatch):
    """GPT-2's column-parallel matmuls gather their inputs themselves: where their blocks run around
    the ring those inputs are kept as the device's tokens, where they run whole (these blocks, by
    default) whole, as the unfused gather kept them; and the runtime's block rule
    (``column_block_of`` on its tensors) reads the same FLOPs and bytes as the cost model's."""
    import partita.cost.collective_matmul as collective_costs
    from partita.cost.collective_matmul import column_block_of

    graph, degree, microbatch = _graph("gpt2"), 2, 3
    cluster = Cluster(device="h100", num_devices=degree)
    table = analytic_costs(graph, "h100", microbatch)
    layout = find_sequence_layout(graph, degree)
    gathered = layout.gathered_nodes | set(layout.fused_gathers)
    unfused = tensor_parallel_costs(
        table, graph, dataclasses.replace(layout, fused_gathers={}, gathered_nodes=gathered), cluster
    )
    whole = tensor_parallel_costs(table, graph, layout, cluster)
    np.testing.assert_array_equal(whole.activation_bytes, unfused.activation_bytes)
    monkeypatch.setattr(collective_costs, "RING_MIN_BLOCK_FLOPS", 0)
    monkeypatch.setattr(collective_costs, "RING_MIN_BLOCK_BYTES", 0)
    tokens = tensor_parallel_costs(table, graph, layout, cluster)
    assert tokens.activation_bytes.sum() < unfused.activation_bytes.sum()
    for matmul in layout.fused_gathers.values():  # selective recomputation keeps the product
        k = graph.node(matmul).index
        assert whole.saved_bytes[k] == tokens.saved_bytes[k] == unfused.saved_bytes[k]  # its output alone
    scale = microbatch / graph.batch_size
    for gathered, matmul in layout.fused_gathers.items():
        x, node = graph.node(gathered).outputs[0], graph.node(matmul)
        local = [s * microbatch // graph.batch_size if d == x.batch_dim else s for d, s in enumerate(x.shape)]
        local[len(local) - 2] //= degree  # this device's tokens: of (B*T, C) rows, of (B, T, C) the LM head's
        runtime = column_block_of(tuple(local), node.outputs[0].shape[-1] // degree, 4)
        model = (node.flops * scale / degree**2, value_bytes(graph, microbatch)[graph.node(gathered).index] / degree)
        assert model == pytest.approx(runtime), matmul


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_cost_model_sizes_the_blocks_as_the_runtime_does(name):
    """Which row-parallel matmuls run around the ring is one rule (``decomposes``) on one block's FLOPs
    and output bytes: the cost model takes them from the graph's node FLOPs and output bytes, the
    runtime from its tensors' shapes (``block_of``); both give the same numbers at any micro-batch."""
    from partita.cost.collective_matmul import block_of
    from partita.cost.table import output_bytes

    graph, degree, microbatch = _graph(name), 2, 3
    layout = find_sequence_layout(graph, degree)
    rows = [n for n in graph.nodes if n.name in layout.sharded_nodes and n.name in layout.sequence_nodes]
    rows = [n for n in rows if kept_mask(graph)[n.index]]
    assert rows
    scale = microbatch / graph.batch_size
    for node in rows:
        x = graph.nodes[node.inputs[0]].outputs[0]
        local = [s * microbatch // graph.batch_size if d == x.batch_dim else s for d, s in enumerate(x.shape)]
        local[-1] //= degree  # the device's part of the contracted features
        runtime = block_of(tuple(local), node.outputs[0].shape[-1], degree, 4)
        model = (node.flops * scale / degree**2, output_bytes(graph, microbatch)[node.index] / degree)
        assert model == pytest.approx(runtime), node.name


def test_fused_row_seconds_hide_the_ring_behind_longer_blocks():
    from partita.cost.collective_matmul import fused_row_seconds
    from partita.types.devices import get_device

    device = get_device("h100")
    zero = np.zeros(2)
    seconds = fused_row_seconds(
        forward_s=np.array([8.0, 1.0]),
        backward_s=np.array([16.0, 2.0]),
        backward_weight_s=np.array([8.0, 1.0]),
        forward_ring_s=np.array([3.0, 3.0]),
        backward_ring_s=np.array([3.0, 3.0]),
        output_block_bytes=zero,
        input_block_bytes=zero,
        contiguous=np.array([False, False]),
        degree=4,
        device=device,
    )
    # blocks of 2 s against steps of 1 s: only the kernels' launches; blocks of 0.25 s: 3 x 0.75 s more
    launch = device.op_overhead_s
    np.testing.assert_allclose(seconds.forward, [3 * 2 * launch, 3 * (0.75 + 2 * launch)])
    # backward: the input-gradient part's blocks (16 - 8 and 2 - 1 s) hide the gradient's all-gather
    np.testing.assert_allclose(seconds.backward, [3 * 3 * launch, 3 * (0.75 + 3 * launch)])


def test_contiguous_token_blocks_need_no_copies():
    """Where a block's rows are contiguous the ring copies no input block and, backward, writes each
    product and received block in place (one launch per step; this device's own block copied once);
    the forward still adds each received partial (three output blocks)."""
    from partita.cost.collective_matmul import fused_column_seconds, fused_row_seconds
    from partita.types.devices import get_device

    device = get_device("h100")
    rate = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    launch, out_block, in_block = device.op_overhead_s, 4e6, 1e6
    common = dict(
        forward_s=np.array([8.0, 8.0]),
        backward_s=np.array([16.0, 16.0]),
        backward_weight_s=np.array([8.0, 8.0]),
        forward_ring_s=np.array([3.0, 3.0]),
        backward_ring_s=np.array([3.0, 3.0]),
        output_block_bytes=np.array([out_block, out_block]),
        contiguous=np.array([False, True]),
        degree=4,
        device=device,
    )
    rows = fused_row_seconds(**common, input_block_bytes=np.array([in_block, in_block]))
    forward = [2 * launch + (2 * in_block + 3 * out_block) / rate, 2 * launch + 3 * out_block / rate]
    np.testing.assert_allclose(rows.forward, 3 * np.array(forward))
    backward = [3 * 3 * launch + 3 * 2 * (in_block + out_block) / rate, 3 * launch + launch + 2 * out_block / rate]
    np.testing.assert_allclose(rows.backward, backward)
    columns = fused_column_seconds(**common)
    np.testing.assert_allclose(columns.forward, 3 * np.array([2 * launch + 2 * out_block / rate, launch]))


def test_the_planner_pins_or_searches_it():
    graph = _graph("gpt2")
    cluster = Cluster(device="h100", num_devices=2)

    def planned(**pins):
        options = PlanOptions(costs="analytic", tensor_parallel=2, num_stages=1, **pins)
        return partita.plan(graph, cluster=cluster, global_batch_size=64, options=options)  # activations peak

    on, off = planned(sequence_parallel=True), planned(sequence_parallel=False)
    assert on.sequence_parallel and not off.sequence_parallel
    assert on.stages[0].memory_breakdown.activations_bytes < off.stages[0].memory_breakdown.activations_bytes
    assert "tensor + sequence parallel" in on.summary() and "tp2 sp" in on.summary()
    assert planned().stages in (on.stages, off.stages)  # searched: one of the two
    with pytest.raises(partita.InputError, match="sequence_parallel=True.*tensor_parallel=1"):
        PlanOptions(tensor_parallel=1, sequence_parallel=True)


def test_plan_files_carry_it_and_refuse_it_without_tensor_parallelism(tmp_path):
    graph = _graph("gpt2")
    options = PlanOptions(costs="analytic", tensor_parallel=2, num_stages=1, sequence_parallel=True)
    plan = partita.plan(graph, cluster=Cluster(device="h100", num_devices=2), global_batch_size=8, options=options)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert partita.Plan.load(str(path)) == plan
    data = json.loads(path.read_text())
    data["stages"][0]["tensor_parallel"], data["stages"][0]["ranks"] = 1, [0]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"sequence_parallel is true, but its tensor_parallel is 1"):
        partita.Plan.load(str(path))

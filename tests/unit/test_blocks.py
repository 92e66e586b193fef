"""Blocks as the unit of execution (issue 56): the repeated blocks found on the graph, the segments
a stage runs by, the memory model's per-block terms, what a sharded stage's gathers show, and one
stage run segment by segment against the stage run whole (the ranks' side: tests/dist)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.cost.segment_memory import SegmentTotals, segment_totals, unit_bytes
from partita.planning.sharding import ShardedExposure
from partita.runtime.pipeline import _SELECTIVE_CONTEXTS
from partita.runtime.segments import segment_stage
from partita.runtime.stages import flatten_inputs, split_graph
from partita.types import Recompute
from partita.types.segments import stage_segments


@pytest.fixture(scope="module")
def llama():
    ex = examples.build("llama", batch_size=4)
    return ex, partita.capture(ex.model, ex.args, ex.kwargs)


@pytest.mark.parametrize(
    "family, paths",
    [
        ("gpt2", ["transformer.h.0", "transformer.h.1"]),
        ("llama", ["model.layers.0", "model.layers.1"]),
        ("t5", ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
        ("albert", []),  # one layer applied at every depth: no list of repeated items
    ],
)
def test_the_repeated_blocks_are_found_with_their_node_ranges(family, paths):
    ex = examples.build(family, batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    blocks = graph.blocks
    assert [b.module_path for b in blocks] == paths
    for block, after in zip(blocks, blocks[1:]):
        assert block.stop <= after.start
    for block in blocks:
        inside = {n.module_path for n in graph.nodes[block.start : block.stop] if n.module_path}
        assert all(p == block.module_path or p.startswith(block.module_path + ".") for p in inside), inside
    if family in ("gpt2", "llama"):
        assert len({b.structure for b in blocks}) == 1, "the layers compute alike"


def test_a_stage_runs_by_its_whole_blocks(llama):
    _, graph = llama
    (b0, b1), n = graph.blocks, graph.num_nodes
    assert [(s.start, s.stop, s.block) for s in stage_segments(graph, 0, n)] == [
        (0, b0.start, None),
        (b0.start, b1.start, b0),
        (b1.start, b1.stop, b1),
        (b1.stop, n, None),
    ]
    inside = b0.start + 5  # a cut inside block 0: it joins the nodes before block 1
    assert [(s.start, s.stop, s.block) for s in stage_segments(graph, inside, n)] == [
        (inside, b1.start, None),
        (b1.start, b1.stop, b1),
        (b1.stop, n, None),
    ]
    assert [(s.start, s.stop) for s in stage_segments(graph, inside, b1.start + 3)] == [(inside, b1.start + 3)]


def test_the_per_block_terms_of_a_stage(llama):
    _, graph = llama
    costs = analytic_costs(graph, "h100", 2)
    (b0, b1), n = graph.blocks, graph.num_nodes
    trainable = int(np.asarray(costs.param_bytes)[np.asarray(costs.param_trainable, dtype=bool)].sum())
    t = segment_totals(costs, 0, n, trainable)
    activation = np.asarray(costs.activation_bytes, dtype=np.float64)
    segments = [(0, b0.start), (b0.start, b1.start), (b1.start, b1.stop), (b1.stop, n)]
    assert t.full_rebuilding == max(activation[a:b].sum() for a, b in segments)
    # the stage's input, then at each later segment start the values made since the one before
    assert t.kept_inputs == costs.cut_bytes[0] + costs.block_input_bytes.sum() + costs.block_output_bytes[1]
    assert costs.block_input_bytes[1] < costs.cut_bytes[b1.start], "values relayed through the blocks count once"
    units = unit_bytes(costs)
    assert units[0] == units[1] > 0
    assert t.root == trainable - units.sum() and t.largest_unit == units[0]
    assert t.gathered == t.root + 2 * units[0] == trainable  # two blocks: the running one and the next
    # a stage without a whole block is one unit: every term is the stage's whole
    inner = segment_totals(costs, b0.start + 3, b1.start + 3, 1000)
    assert inner.kept_inputs == costs.cut_bytes[b0.start + 3] and inner.gathered == inner.recompute_weights == 1000
    assert inner.full_rebuilding == activation[b0.start + 3 : b1.start + 3].sum()
    # vectorised over ranges, as the search asks
    many = segment_totals(costs, np.array([0, b0.start + 3]), np.array([n, b1.start + 3]), np.array([trainable, 1000]))
    assert list(many.kept_inputs) == [t.kept_inputs, inner.kept_inputs]


def test_a_sharded_stage_by_block_shows_its_first_gather_and_its_roots_reduce_scatter():
    by_block = SegmentTotals(0, 0, 0, 0, 0, root=1, largest_unit=1)
    shown = ShardedExposure(gather_s=10.0, first_gather_s=2.0, reduce_s=8.0, root_reduce_s=1.0, by_block=True)
    assert shown.gather_shown(3.0) == 2.0 + (10.0 - 2.0 - 3.0)  # the rest overlaps 3 s of compute
    assert shown.gather_shown(20.0) == 2.0  # compute hides all but the first
    assert shown.reduce_shown(5.0) == 3.0 and shown.reduce_shown(20.0) == 1.0
    whole = ShardedExposure(gather_s=10.0, first_gather_s=10.0, reduce_s=8.0, root_reduce_s=8.0, by_block=False)
    assert whole.gather_shown(3.0) == 7.0 and whole.reduce_shown(5.0) == 8.0
    assert by_block.first_gathered == 2


@pytest.mark.parametrize("level", [Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE])
def test_a_stage_run_segment_by_segment_equals_the_stage_run_whole(llama, level):
    ex, graph = llama
    flat = flatten_inputs(graph, ex.args, ex.kwargs)

    def run(segmented: bool) -> tuple[float, dict]:
        (stage,) = split_graph(graph, [0, graph.num_nodes])
        ex.model.zero_grad()
        inputs = stage.graph_inputs(flat)
        if segmented:
            split = segment_stage(stage, graph)
            assert split is not None and split.num_segments == 4
            loss = split.run(stage.state_tensors, inputs, recompute=level, context_fn=_SELECTIVE_CONTEXTS)
        else:
            loss = stage(*inputs)
        loss.backward()
        return float(loss), {k: p.grad.clone() for k, p in ex.model.named_parameters() if p.grad is not None}

    whole_loss, whole = run(False)
    loss, grads = run(True)
    assert loss == whole_loss and grads.keys() == whole.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, whole[name]), name

"""partita.planning.chain: legal cuts, coarsening into blocks, block costs and layer boundaries."""

from __future__ import annotations

import ast
import dataclasses

import numpy as np
import pytest

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.errors import InputError
from partita.planning import chain
from partita.planning.chain import block_costs, coarsen, layer_boundaries, legal_cuts, per_sample_cuts
from partita.types import CostTable, GraphInput, OpGraph, OpNode, ParamInfo, TensorInfo

F32 = TensorInfo(shape=(2, 4), dtype="float32", num_bytes=32, batch_dim=0)


# ----------------------------------------------------------------------------- hand-built graphs


def make_graph(specs: list[dict], params: tuple[str, ...] = ()) -> OpGraph:
    """An OpGraph from node specs: name, target, inputs, and optionally graph_inputs, params,
    outputs (default one float tensor), is_view, is_higher_order, module_path."""
    consumers: dict[int, list[int]] = {i: [] for i in range(len(specs))}
    for i, spec in enumerate(specs):
        for p in spec.get("inputs", ()):
            consumers[p].append(i)
    nodes = tuple(
        OpNode(
            index=i,
            name=spec["name"],
            target=spec.get("target", "aten.relu.default"),
            module_path=spec.get("module_path", ""),
            module_type="",
            source="",
            outputs=spec.get("outputs", (F32,)),
            inputs=tuple(spec.get("inputs", ())),
            graph_inputs=tuple(spec.get("graph_inputs", ())),
            params=tuple(spec.get("params", ())),
            consumers=tuple(consumers[i]),
            is_view=spec.get("is_view", False),
            is_higher_order=spec.get("is_higher_order", False),
        )
        for i, spec in enumerate(specs)
    )
    parameters = {name: ParamInfo(name=name, shape=(4, 4), dtype="float32", num_bytes=64) for name in params}
    return OpGraph(
        nodes=nodes,
        inputs=(GraphInput(name="x", path="args[0]", tensor=F32),),
        parameters=parameters,
        loss_node=len(nodes) - 1,
        batch_size=2,
        dynamic_batch=True,
        fingerprint="test",
        graph_module=None,
        exported_program=None,
    )


def test_parameter_view_must_not_cross():
    g = make_graph(
        [
            dict(name="x1", target="aten.mul.Tensor", graph_inputs=(0,)),
            dict(name="wt", target="aten.t.default", params=("w",), is_view=True),  # a view of the weight
            dict(name="y", inputs=(0,)),
            dict(name="z", target="aten.mm.default", inputs=(2, 1)),
        ],
        params=("w",),
    )
    # Cut 1 ships x1 only; cuts 2 and 3 would ship the transposed weight.
    assert legal_cuts(g).tolist() == [True, True, False, False, True]


def test_tuple_must_not_cross_but_its_items_may():
    two = (F32, F32)
    g = make_graph(
        [
            dict(name="h", graph_inputs=(0,)),
            dict(name="pair", target="wrap_with_set_grad_enabled", inputs=(0,), outputs=two, is_higher_order=True),
            dict(name="a", target="operator.getitem", inputs=(1,), is_view=True),
            dict(name="b", target="operator.getitem", inputs=(1,), is_view=True),
            dict(name="c", target="aten.add.Tensor", inputs=(2, 3)),
        ]
    )
    # Cuts 2 and 3 lie between the tuple and its getitems; at cut 4 the two items cross, and
    # they are separate tensors (a higher-order op's outputs), so that is fine.
    assert legal_cuts(g).tolist() == [True, True, False, False, True, True]


def test_items_of_a_split_share_storage():
    three = (F32, F32, F32)
    g = make_graph(
        [
            dict(name="h", graph_inputs=(0,)),
            dict(name="split", target="aten.split.Tensor", inputs=(0,), outputs=three, is_view=True),
            dict(name="a", target="operator.getitem", inputs=(1,), is_view=True),
            dict(name="b", target="operator.getitem", inputs=(1,), is_view=True),
            dict(name="c", target="aten.add.Tensor", inputs=(2, 3)),
        ]
    )
    assert legal_cuts(g).tolist() == [True, True, False, False, False, True]


def test_tensor_and_its_view_must_not_both_cross():
    g = make_graph(
        [
            dict(name="h", graph_inputs=(0,)),
            dict(name="v", target="aten.view.default", inputs=(0,), is_view=True),
            dict(name="k", target="aten.exp.default", graph_inputs=(0,)),
            dict(name="out", target="aten.add.Tensor", inputs=(0, 1, 2)),
        ]
    )
    # Cut 1: only h crosses. Cut 2 falls just after the view while its base is still read:
    # h and v would be two copies of one storage; so does cut 3.
    assert legal_cuts(g).tolist() == [True, True, False, False, True]


def test_a_view_alone_may_cross():
    g = make_graph(
        [
            dict(name="h", graph_inputs=(0,)),
            dict(name="v", target="aten.view.default", inputs=(0,), is_view=True),
            dict(name="k", target="aten.exp.default", graph_inputs=(0,)),
            dict(name="out", target="aten.add.Tensor", inputs=(1, 2)),
        ]
    )
    assert legal_cuts(g).all()


def test_symints_from_inputs_cross_others_do_not():
    g = make_graph(
        [
            dict(name="batch", target="aten.sym_size.int", graph_inputs=(0,), outputs=(), is_view=True),
            dict(name="h", graph_inputs=(0,)),
            dict(name="rows", target="aten.sym_size.int", inputs=(1,), outputs=(), is_view=True),
            dict(name="g", inputs=(1,)),
            dict(name="out", target="aten.view.default", inputs=(3, 0, 2), is_view=True),
        ]
    )
    # "batch" is recomputed from the input by every stage; "rows" reads an activation.
    assert legal_cuts(g).tolist() == [True, True, True, False, False, True]


def test_block_param_matrix_worked_example():
    # 5 nodes, 4 blocks (node 3 and 4 form block 3); "tied" is read in blocks 0 and 3,
    # "w1" (frozen) in block 1, "b" (a buffer) in blocks 1 and 2; "unused" by nobody.
    costs = CostTable(
        microbatch_size=1,
        device="cpu",
        source="analytic",
        forward_s=np.arange(5.0),
        backward_s=2 * np.arange(5.0),
        backward_weight_s=np.ones(5),
        activation_bytes=np.array([1, 2, 3, 4, 5]),
        output_bytes=np.array([10, 50, 20, 30, 40]),
        cut_bytes=np.array([0, 7, 8, 9, 6, 0]),
        param_names=("tied", "w1", "b", "unused"),
        param_bytes=np.array([100, 20, 3, 1000]),
        param_trainable=np.array([True, False, False, True]),
        param_uses=(np.array([0, 4]), np.array([1]), np.array([1, 2]), np.array([], dtype=np.int64)),
    )
    blocks = block_costs(costs, [0, 1, 2, 3, 5])
    assert blocks.num_blocks == 4
    assert blocks.forward_s.tolist() == [0, 1, 2, 7]
    assert blocks.backward_s.tolist() == [0, 2, 4, 14]
    assert blocks.backward_weight_s.tolist() == [1, 1, 1, 2]
    assert blocks.activation_bytes.tolist() == [1, 2, 3, 9]
    assert blocks.max_output_bytes.tolist() == [10, 50, 20, 40]
    assert blocks.cut_bytes.tolist() == [0, 7, 8, 9, 0]
    expected = {(0, 1): 100, (0, 2): 123, (1, 2): 23, (1, 3): 23, (2, 3): 3, (1, 4): 123, (2, 4): 103, (3, 4): 100}
    for (j, i), value in expected.items():
        assert blocks.param_bytes(j, i) == value, (j, i)
    assert blocks.param_bytes(1, 3, trainable=True) == 0
    assert blocks.param_bytes(0, 4, trainable=True) == 100
    assert np.all(np.tril(blocks.param_bytes_matrix) == 0)


def test_block_costs_rejects_bad_boundaries():
    g = make_graph([dict(name="a", graph_inputs=(0,)), dict(name="b", inputs=(0,))])
    costs = CostTable(
        microbatch_size=1,
        device="cpu",
        source="analytic",
        forward_s=np.ones(2),
        backward_s=np.ones(2),
        backward_weight_s=np.zeros(2),
        activation_bytes=np.zeros(2),
        output_bytes=np.zeros(2),
        cut_bytes=np.zeros(3),
        param_names=(),
        param_bytes=np.zeros(0),
        param_trainable=np.zeros(0, dtype=bool),
        param_uses=(),
    )
    with pytest.raises(InputError):
        block_costs(costs, [0, 1, 1, 2])
    with pytest.raises(InputError):
        coarsen(g, costs, max_blocks=0)


def test_layer_boundaries_from_module_paths():
    paths = [
        "",
        "model.embed",
        "model.layers.0.attn",
        "model.layers.0.attn.q.0",
        "model.layers.0",
        "model.layers.1.attn",
        "encoder.block.0",
        "model.norm",
        "head",
    ]
    g = make_graph([dict(name=f"n{i}", graph_inputs=(0,), module_path=p) for i, p in enumerate(paths)])
    assert layer_boundaries(g) == [2, 5]


def test_chain_does_not_import_torch():
    tree = ast.parse(open(chain.__file__).read())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in modules if m.split(".")[0] == "torch"]


# ----------------------------------------------------------------------------- real models


@pytest.fixture(scope="module", params=["gpt2", "llama", "t5"])
def captured(request):
    ex = examples.build(request.param, batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    return request.param, graph, analytic_costs(graph, "h100", 8)


def crossing(graph: OpGraph, c: int) -> list[OpNode]:
    return [n for n in graph.nodes[:c] if n.consumers and max(n.consumers) >= c]


def test_layer_starts_are_legal_cuts_where_the_hidden_state_crosses(captured):
    name, graph, costs = captured
    hidden_size = {"gpt2": 64, "llama": 64, "t5": 64}[name]
    layers = layer_boundaries(graph)
    assert len(layers) == (4 if name == "t5" else 2)  # T5: encoder and decoder blocks together
    legal = legal_cuts(graph)
    assert legal[0] and legal[-1]
    for c in layers[1:]:
        assert legal[c]
        values = crossing(graph, c)
        print(name, c, [(n.name, n.outputs[0].shape if n.outputs else "SymInt") for n in values])
        hidden = [n for n in values if n.outputs and n.outputs[0].shape == (8, 32, hidden_size)]
        # The hidden state; in T5's decoder also the encoder's output (cross-attention reads it).
        decoder = name == "t5" and graph.nodes[c].module_path.startswith("decoder")
        assert len(hidden) == (2 if decoder else 1)
        assert costs.cut_bytes[c] == sum(n.output_bytes for n in values)
        others = [n for n in values if n not in hidden]  # SymInts, masks, position biases, rotary tables
        assert all(not n.outputs or (len(n.outputs) == 1 and n.outputs[0].shape[-1] != hidden_size) for n in others)


@pytest.mark.parametrize("max_blocks", [1, 3, 8, 20, 256])
def test_coarsen_returns_legal_sorted_deterministic_blocks(captured, max_blocks):
    name, graph, costs = captured
    boundaries = coarsen(graph, costs, max_blocks=max_blocks)
    legal = legal_cuts(graph)
    assert boundaries[0] == 0 and boundaries[-1] == graph.num_nodes
    assert np.all(np.diff(boundaries) > 0)
    assert len(boundaries) - 1 <= max_blocks
    assert legal[boundaries].all()
    assert np.array_equal(boundaries, coarsen(graph, costs, max_blocks=max_blocks))
    if max_blocks >= legal.sum() - 1:
        assert np.array_equal(boundaries, np.flatnonzero(legal))  # small graphs keep every legal cut
    blocks = block_costs(costs, boundaries)
    assert blocks.forward_s.sum() == pytest.approx(costs.forward_s.sum())
    assert blocks.backward_s.sum() == pytest.approx(costs.backward_s.sum())
    assert blocks.backward_weight_s.sum() == pytest.approx(costs.backward_weight_s.sum())
    assert blocks.activation_bytes.sum() == costs.activation_bytes.sum()
    assert blocks.max_output_bytes.max() == costs.output_bytes.max()
    assert np.array_equal(blocks.cut_bytes, costs.cut_bytes[boundaries])


def test_coarsen_keeps_layer_starts_and_balances(captured):
    name, graph, costs = captured
    boundaries = coarsen(graph, costs, max_blocks=12)
    assert set(layer_boundaries(graph)) <= set(boundaries.tolist())
    blocks = block_costs(costs, boundaries)
    work = blocks.forward_s + blocks.backward_s
    assert work.max() < 0.5 * work.sum()  # no block holds most of the model


def test_a_very_costly_node_is_its_own_block(captured):
    name, graph, costs = captured
    heavy = max(range(graph.num_nodes), key=lambda n: costs.forward_s[n])
    forward = costs.forward_s.copy()
    forward[heavy] = 10 * forward.sum()
    boundaries = coarsen(graph, dataclasses.replace(costs, forward_s=forward), max_blocks=16)
    legal = np.flatnonzero(legal_cuts(graph))
    before = legal[legal <= heavy][-1]
    after = legal[legal > heavy][0]
    assert before in boundaries and after in boundaries
    assert np.searchsorted(boundaries, after) == np.searchsorted(boundaries, before) + 1


def test_block_param_matrix_matches_brute_force(captured):
    name, graph, costs = captured
    boundaries = coarsen(graph, costs, max_blocks=24)
    blocks = block_costs(costs, boundaries)
    k = blocks.num_blocks
    rng = np.random.default_rng(0)
    pairs = [(0, k), (0, 1), (k - 1, k)] + [tuple(sorted(rng.choice(k + 1, size=2, replace=False))) for _ in range(60)]
    for j, i in pairs:
        held = costs.params_in_range(int(boundaries[j]), int(boundaries[i]))
        assert blocks.param_bytes(j, i) == sum(int(costs.param_bytes[p]) for p in held), (j, i)
        assert blocks.param_bytes(j, i, trainable=True) == sum(
            int(costs.param_bytes[p]) for p in held if costs.param_trainable[p]
        ), (j, i)


def test_tied_embedding_is_held_only_by_its_ends():
    ex = examples.build("gpt2", batch_size=2)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    costs = analytic_costs(graph, "h100", 2)
    blocks = block_costs(costs, coarsen(graph, costs, max_blocks=10))
    wte = costs.param_names.index("transformer.wte.weight")
    k = blocks.num_blocks
    first, last = costs.param_uses[wte][0], costs.param_uses[wte][-1]
    assert np.searchsorted(blocks.boundaries, first, side="right") - 1 == 0
    assert np.searchsorted(blocks.boundaries, last, side="right") - 1 == k - 1
    middle = blocks.param_bytes(1, k - 1)
    assert blocks.param_bytes(0, k) - middle >= costs.param_bytes[wte]  # not in the middle
    assert blocks.param_bytes(1, k) - blocks.param_bytes(1, k - 1) >= costs.param_bytes[wte]


@pytest.mark.slow
def test_gpt2_xl_on_meta_coarsens_into_at_most_256_blocks():
    ex = examples.build("gpt2-xl", batch_size=2, device="meta")
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    costs = analytic_costs(graph, "h100", 1)
    boundaries = coarsen(graph, costs)  # its time is in bench/plan_time.py, not asserted here
    blocks = block_costs(costs, boundaries)
    assert blocks.num_blocks <= 256
    layers = layer_boundaries(graph)
    assert len(layers) == 48 and set(layers) <= set(boundaries.tolist())
    lm_head = next(n.index for n in graph.nodes if n.module_path == "lm_head")
    assert lm_head in boundaries and lm_head + 1 in boundaries  # the LM head is its own block


def test_per_sample_cuts_exclude_merged_batch_dims():
    """(B*T, H) from a reshape may be batch-major or not: cuts it crosses cannot change replica counts."""
    merged = TensorInfo(shape=(8, 4), dtype="float32", num_bytes=128, batch_dim=0)  # batch 2 x 4 positions
    shared = TensorInfo(shape=(4, 4), dtype="float32", num_bytes=64, batch_dim=None)  # no batch dim: sent whole
    graph = make_graph(
        [
            dict(name="a", graph_inputs=(0,)),
            dict(name="flat", inputs=(0,), outputs=(merged,), is_view=True),
            dict(name="mm", inputs=(1,), outputs=(merged,)),
            dict(name="back", inputs=(2,)),
            dict(name="table", outputs=(shared,)),
            dict(name="out", inputs=(3, 4)),
        ]
    )
    assert per_sample_cuts(graph).tolist() == [True, True, False, False, True, True, True]


def test_per_sample_cuts_hold_at_layer_starts(captured):
    """Where the hidden state (B, T, H) crosses, stages may have different replica counts."""
    _, graph, _ = captured
    cuts = per_sample_cuts(graph)
    assert all(cuts[c] for c in layer_boundaries(graph))
    assert not cuts.all()  # the attention and MLP matmuls run on (B*T, H)


def test_coarsen_requires_whole_layers_also_when_they_outnumber_half_the_blocks():
    """96 layers in 128 blocks keep every layer start (Megatron's 310B runs 3 layers per stage,
    which only a chain cut at every layer start can express); 128 layers keep every second one;
    a single block keeps none."""
    from partita.planning.chain import _required_layer_starts

    starts = np.arange(5, 5 + 96 * 10, 10)
    assert np.array_equal(_required_layer_starts(starts, 128), starts)
    many = np.arange(5, 5 + 128 * 10, 10)
    assert np.array_equal(_required_layer_starts(many, 128), many[::2])
    assert len(_required_layer_starts(starts, 1)) == 0
    for max_blocks in (2, 3, 8, 20, 64):
        assert len(_required_layer_starts(many, max_blocks)) <= max(max_blocks // 2, max_blocks - 2)


def _stack(num_layers: int) -> OpGraph:
    """A chain of ``num_layers`` two-node layers ("layers.i") between an embedding and a head."""
    specs = [dict(name="embed", graph_inputs=(0,), module_path="embed")]
    for i in range(num_layers):
        first = len(specs)
        specs.append(dict(name=f"mm{i}", inputs=(first - 1,), module_path=f"layers.{i}.mm"))
        specs.append(dict(name=f"act{i}", inputs=(first,), module_path=f"layers.{i}.act"))
    specs.append(dict(name="head", inputs=(len(specs) - 1,), module_path="head"))
    return make_graph(specs)


def test_the_default_block_count_keeps_every_layer_start_of_a_deep_model():
    """128 blocks up to 112 layers; beyond, the least count whose chain still starts a block at every
    layer (a 1T GPT's 128 layers on 64 rank groups x 2 interleaved stages of one layer each)."""
    assert chain.default_max_blocks(_stack(112)) == chain.DEFAULT_MAX_BLOCKS
    deep = _stack(140)
    blocks = chain.default_max_blocks(deep)
    assert 140 + max(2, blocks // 8) == blocks  # the least: an eighth left around the layers
    costs = analytic_costs(deep, "cpu", 2)
    starts = layer_boundaries(deep)
    assert len(starts) == 140 and set(starts) <= set(coarsen(deep, costs, max_blocks=blocks).tolist())
    assert not set(starts) <= set(coarsen(deep, costs, max_blocks=chain.DEFAULT_MAX_BLOCKS).tolist())

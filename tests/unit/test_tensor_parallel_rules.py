"""The tensor-parallel rules on captured graphs (partita.capturing.tensor_parallel): which matmuls
split, how their weights split, and what stays whole and why. Numerics: tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import partita
from partita import examples
from partita.capturing.tensor_parallel import analyze, find_layout
from partita.cost.analytic import analytic_costs
from partita.cost.tensor_parallel import reduction_times_s
from partita.errors import InputError
from partita.types import Cluster
from partita.types.tensor_parallel import ParamShard

pytest.importorskip("transformers")


@functools.cache
def _graph(name: str):
    ex = examples.build(name, batch_size=2, seq_len=8)
    return partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def test_gpt2_fused_qkv_splits_by_heads_and_the_tied_head_by_vocabulary():
    layout = find_layout(_graph("gpt2"), 2)
    assert layout.params["transformer.h.0.attn.c_attn.weight"] == ParamShard(1, 3)  # Conv1D (in, out): q, k, v
    assert layout.params["transformer.h.0.attn.c_attn.bias"] == ParamShard(0, 3)
    assert layout.params["transformer.h.0.attn.c_proj.weight"] == ParamShard(0)  # row-parallel
    assert "transformer.h.0.attn.c_proj.bias" not in layout.params  # added once, after the all-reduce
    tied = {"transformer.wte.weight", "lm_head.weight"} & set(layout.params)
    assert tied and all(layout.params[n] == ParamShard(0) for n in tied)
    assert "transformer.wpe.weight" not in layout.params  # positions: not a vocabulary
    assert not layout.rejected
    # per layer: attention and MLP outputs all-reduced, (B, S, H) elements each; the loss: 3 per row
    graph = _graph("gpt2")
    rows = graph.batch_size * 8
    assert sorted(set(layout.forward_reductions.values())) == [3 * rows, rows * 64]


def test_a_vocabulary_splits_at_a_hidden_size_near_its_own():
    """Megatron's 1T GPT maps 51,200 tokens to 25,600 features: two rows per column, still a
    vocabulary (``VOCAB_MIN_ROWS``), so the tied embedding and LM head split along it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=1,
        n_embd=8192,
        n_head=64,
        vocab_size=16384,
        n_positions=16,
        use_cache=False,
        attn_implementation="eager",
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    layout = find_layout(partita.capture(model, (), {"input_ids": ids, "labels": ids}), 8)
    tied = {"transformer.wte.weight", "lm_head.weight"} & set(layout.params)
    assert tied and all(layout.params[n] == ParamShard(0) for n in tied)
    assert not layout.rejected


def test_gqa_with_fewer_kv_heads_than_the_degree_leaves_keys_and_values_whole():
    two = find_layout(_graph("llama"), 2)
    assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"} <= set(two.params)
    four = find_layout(_graph("llama"), 4)  # 4 query heads, 2 key/value heads
    assert "model.layers.0.self_attn.q_proj.weight" in four.params
    assert "model.layers.0.self_attn.k_proj.weight" not in four.params
    assert any("cannot run on a split value" in why for why in four.rejected.values())
    graph = _graph("llama")
    found = analyze(graph.graph_module.graph, 4, outputs=(graph.nodes[graph.loss_node].name,))
    assert found.scatters, "the whole keys are sliced to the local query heads"


@pytest.mark.parametrize("name", ["bert", "t5"])
def test_encoder_models_split_attention_and_mlp(name):
    layout = find_layout(_graph(name), 2)
    attention = [n for n in layout.params if ("attention" in n.lower() or "SelfAttention" in n)]
    assert len(attention) >= 8
    assert all(s.blocks == 1 for s in layout.params.values())


def test_the_reductions_of_a_whole_operand_are_costed_on_its_node():
    """T5 adds its whole position bias to the split attention scores: the bias's gradient is
    all-reduced in the backward of that add, which the cost model finds by the node's name."""
    graph = _graph("t5")
    layout = find_layout(graph, 2)
    names = {n.name for n in graph.nodes} | {i.name for i in graph.inputs}
    # the bias has no batch dimension: its all-reduce moves as much at any micro-batch size
    summed = layout.backward_fixed_reductions
    assert set(layout.backward_reductions) | set(summed) <= names
    cluster = Cluster(device="h100", num_devices=2)
    forward, backward = reduction_times_s(analytic_costs(graph, "h100", 2), graph, layout, cluster)
    bias_adds = [n.index for n in graph.nodes if n.name in summed and n.target == "aten.add.Tensor"]
    assert bias_adds and all(backward[i] > 0 for i in bias_adds)
    _, doubled = reduction_times_s(analytic_costs(graph, "h100", 4), graph, layout, cluster)
    assert all(doubled[i] == backward[i] for i in bias_adds)


def test_a_cnn_has_nothing_to_split():
    layout = find_layout(_graph("cnn"), 2)
    assert layout.is_trivial
    assert "too few to split" in layout.rejected["linear"]  # the classifier head's 10 classes


class _Cumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.cumsum(self.up(x), dim=-1)).pow(2).mean()


def test_an_op_without_a_rule_keeps_its_matmuls_whole():
    graph = partita.capture(_Cumsum(), (torch.randn(4, 8),))
    layout = find_layout(graph, 2)
    assert layout.is_trivial
    assert "cumsum" in layout.rejected["linear"] and "no tensor-parallel rule" in layout.rejected["linear"]


def test_degrees_must_be_powers_of_two():
    graph = _graph("mlp")
    assert find_layout(graph, 1).is_trivial
    with pytest.raises(InputError, match="power of 2"):
        find_layout(graph, 3)

"""Profiling and planning a model do not keep it alive after the user drops it.

On the H200 (bench/gpu/check.py, first run), every model the script had captured, profiled and
planned stayed allocated until one more did not fit. Two causes, one test each:
- module-level ``lru_cache``s keyed by the graph held every graph planned in the process and,
  through its exported program, the model's parameters (``partita.types.graph.graph_memo`` now
  keys its memo weakly by the graph);
- the profiler's recorded autograd graph held its saved-tensor hook, which held the recorded
  values: a reference cycle through C++ that Python's collector cannot free.
"""

from __future__ import annotations

import gc
import weakref

import torch

import partita
from partita import examples
from partita.cost.profiler import profile
from partita.types import Cluster
from partita.types.graph import graph_memo


def test_planning_a_model_does_not_keep_it_alive():
    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = Cluster(device="h100", num_devices=4, devices_per_node=4)
    options = partita.PlanOptions(costs="analytic", tensor_parallel=2, recompute="selective")
    plan = partita.plan(graph, cluster=cluster, global_batch_size=8, options=options)
    assert plan.tensor_parallel == 2  # the tensor-parallel analysis and the selective arrays ran
    weights = weakref.ref(next(ex.model.parameters()))
    graph_ref = weakref.ref(graph)
    del ex, graph
    gc.collect()
    assert graph_ref() is None, [type(r).__name__ for r in gc.get_referrers(graph_ref())]
    assert weights() is None


def test_profiling_a_model_does_not_keep_it_or_its_activations_alive():
    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    gc.collect()
    before = _live_tensor_ids()
    table = profile(graph, (ex.args, ex.kwargs, ex.target), microbatch_size=2, repeats=1, warmup=0)
    assert table.activation_bytes.sum() > 0
    gc.collect()
    assert _live_tensor_ids() <= before  # nothing of the recorded runs is left
    weights = weakref.ref(next(ex.model.parameters()))
    del ex, graph
    gc.collect()
    assert weights() is None


def _live_tensor_ids() -> set[int]:
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}


def test_the_memo_remembers_per_graph_and_arguments(mlp_graph):
    calls = []

    @graph_memo
    def nodes_times(graph, k):
        calls.append(k)
        return graph.num_nodes * k

    assert nodes_times(mlp_graph, 2) == nodes_times(mlp_graph, 2) == 2 * mlp_graph.num_nodes
    assert nodes_times(mlp_graph, 3) == 3 * mlp_graph.num_nodes
    assert calls == [2, 3]
    nodes_times.cache_clear()
    nodes_times(mlp_graph, 2)
    assert calls == [2, 3, 2]


def test_a_graph_captures_each_variant_once_and_lets_them_go_with_it():
    """``variants.recaptured``: the trainers of one graph share its variants (one capture per shape
    and mode), and the variants go with the graph (they hold the model)."""
    from partita.runtime.variants import recaptured

    ex = examples.build("gpt2", batch_size=4, seq_len=16)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    short = {k: v[:, :8] for k, v in ex.kwargs.items()}
    first = recaptured(graph, ex.args, short, ex.target, samples=4)
    assert recaptured(graph, ex.args, dict(short), ex.target, samples=4) is first
    assert first.example_inputs[1]["input_ids"].shape == (4, 8)
    evaluation = recaptured(graph, ex.args, short, ex.target, samples=4, training=False)
    fewer = recaptured(graph, ex.args, short, ex.target, samples=2)
    assert len({id(first), id(evaluation), id(fewer)}) == 3
    assert fewer.example_inputs[1]["input_ids"].shape == (2, 8)
    weights, variant = weakref.ref(next(ex.model.parameters())), weakref.ref(first)
    del ex, graph, first, evaluation, fewer
    gc.collect()
    assert variant() is None and weights() is None

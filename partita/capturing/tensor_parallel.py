"""Tensor-parallel structure on a captured graph: Megatron's patterns found on aten ops.

A group of ``degree`` devices runs one graph together. Rules, found here without any
model-specific code:

* **column-parallel** matmul (``linear``, ``addmm``/``mm``/``matmul`` with a weight parameter)
  on a replicated input: each device holds a slice of the output features (weight and bias
  split along them) and its output is *sharded* on the last dim;
* sharded values flow through ops that act on each slice alone -- elementwise ops (a
  replicated operand of full size on the sharded dim is sliced, ``scatter``), views and
  reshapes (the shape argument is divided: ``(B, S, 12 heads, 64)`` -> 6 heads), transposes,
  splits (a fused QKV projection's weight is split per block: ``ParamShard.blocks``), softmax
  and reductions over other dims, batched matmuls and attention over sharded heads (GQA's
  repeated key/value heads included);
* **row-parallel** matmul on an input sharded on its last dim: the weight is split along its
  input features, the partial outputs are all-reduced, then the bias is added;
* **vocab-parallel embedding**: a vocabulary (``is_vocabulary``: rows >= 8 x columns or at least
  16,384 rows; at least 16 columns: not a per-head bias table) is split by rows, looked up
  where it is held and all-reduced;
* **vocab-parallel cross-entropy**: a column-parallel LM head's logits (a vocabulary again, not
  a classifier's few classes) go into
  ``cross_entropy`` without being gathered (max, sum of exponentials and target logit are
  reduced over the group).

Anything else that meets a sharded value -- an op without a rule, a norm over the sharded dim,
a graph output -- rejects the column-parallel matmuls (and embeddings) it came from: they run
replicated, and the search is repeated until every sharded value ends in a row-parallel matmul
or the cross-entropy. Unknown ops are never guessed. So a graph without these patterns (a CNN)
gets an empty layout and runs replicated.

The propagation itself, rule by rule, is ``partita.capturing.tensor_parallel_propagation``.
``analyze`` works on any FX graph (a whole captured graph, or one stage's graph) and returns
what the runtime rewrite (``partita.runtime.tensor_parallel``) needs; ``find_layout`` gives the
planner its ``TensorParallelLayout`` keyed by canonical parameter names.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch.fx

from partita.capturing.tensor_parallel_propagation import (
    VOCAB_MIN_COLUMNS,
    VOCAB_MIN_ROWS,
    VOCAB_ROWS_PER_COLUMN,
    Propagation,
    Sharded,
    TensorParallelAnalysis,
    is_vocabulary,
)
from partita.errors import InputError
from partita.types import OpGraph
from partita.types.graph import graph_memo
from partita.types.tensor_parallel import TensorParallelLayout

__all__ = [
    "VOCAB_MIN_COLUMNS",
    "VOCAB_MIN_ROWS",
    "VOCAB_ROWS_PER_COLUMN",
    "Sharded",
    "TensorParallelAnalysis",
    "analyze",
    "find_layout",
    "is_vocabulary",
]


def find_layout(graph: OpGraph, degree: int) -> TensorParallelLayout:
    """The planner's view: ``analyze`` on the whole captured graph (whose stages return the loss
    alone), parameters by canonical name."""
    return whole_graph_layout(graph, whole_graph_analysis(graph, degree))


@graph_memo
def whole_graph_analysis(graph: OpGraph, degree: int) -> TensorParallelAnalysis:
    """``analyze`` on the whole captured graph, whose stages return the loss alone (remembered per
    graph and degree: the planner asks for it with and without sequence parallelism; read-only)."""
    return analyze(graph.graph_module.graph, degree, outputs=(graph.nodes[graph.loss_node].name,))


def whole_graph_layout(graph: OpGraph, analysis: TensorParallelAnalysis) -> TensorParallelLayout:
    """``analysis`` (of the whole captured graph) as the planner's layout: parameters by canonical name."""
    found = analysis.layout
    params = {graph.attr_to_param.get(target, target): shard for target, shard in found.params.items()}
    return TensorParallelLayout(
        degree=found.degree,
        params=params,
        sharded_nodes=found.sharded_nodes,
        forward_reductions=found.forward_reductions,
        backward_reductions=found.backward_reductions,
        backward_fixed_reductions=found.backward_fixed_reductions,
        rejected=found.rejected,
    )


def analyze(
    graph: torch.fx.Graph,
    degree: int,
    *,
    params: Mapping[str, str] | None = None,
    replicated: Collection[str] = (),
    outputs: Collection[str] | None = None,
) -> TensorParallelAnalysis:
    """The tensor-parallel rewrite of ``graph`` on ``degree`` devices.

    ``params``: node name -> parameter name, for the nodes that read parameters (None: every
    get_attr node, named by its target); the layout is keyed by these names. ``replicated``:
    parameters that must stay whole (a weight another stage reads unsplit). ``outputs``: the
    names of the graph outputs that are used (None: all), which must be whole.
    """
    if degree < 1 or degree & (degree - 1):
        raise InputError(f"tensor-parallel degree must be a power of 2 (1, 2, 4, 8, ...), got {degree!r}")
    if degree == 1:
        return TensorParallelAnalysis(degree, TensorParallelLayout(degree=1))
    rejected: dict[str, str] = {}
    while True:
        run = Propagation(graph, degree, rejected, frozenset(replicated), outputs, params)
        run.propagate()
        failed = run.failures()
        if not failed:
            return run.result()
        rejected.update(failed)

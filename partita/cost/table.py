"""The parts of a CostTable that do not depend on where the times come from.

Both cost sources (``analytic.py``, a roofline estimate, and ``profiler.py``, measurements)
fill the time arrays themselves and take everything else from here: bytes per node output,
cut bytes, activation bytes saved for backward, which nodes need a backward at all, and the
parameter arrays. ``contended`` rescales a finished table's compute times.

Glossary
--------
value           what node n computes: the tuple of its tensor outputs (``OpNode.outputs``).
storage root    the node whose memory a value lives in. A view (``is_view``: views, getitem,
                no-op casts, in-place ops) lives in its first tensor input's root; any other
                node is its own root. Graph inputs are roots too; parameters are nobody's
                activation.
scaled          bytes at the micro-batch size: batch-proportional tensors (``batch_dim`` set)
                scale by ``microbatch_size / graph.batch_size``, the rest stay.
precision       the dtype values are computed in (``Precision``): under bf16 every float32 value
                of the captured graph counts at 2 bytes per element (the runtime computes with
                bf16 parameter copies, so every float32 activation becomes bf16); other dtypes
                (integer ids, masks, float64) keep theirs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from partita.types import CostTable, OpGraph, OpNode, Precision, TensorInfo
from partita.types.graph import graph_memo

__all__ = [
    "FLOAT_DTYPES",
    "ParamArrays",
    "activation_bytes",
    "compute_dtype",
    "contended",
    "costs_nothing",
    "block_bytes",
    "cut_bytes",
    "is_inplace",
    "op_name",
    "output_bytes",
    "param_arrays",
    "requires_grad",
    "storage_roots",
    "tensor_bytes",
    "value_bytes",
    "backward_read_bytes",
]

FLOAT_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"}
)
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

# Ops whose float outputs never carry a gradient, whatever their inputs.
_NO_GRAD_OPS = frozenset(
    {
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty",
        "detach",
        "bernoulli",
    }
)

# What an op's backward keeps from its forward (PyTorch's derivatives.yaml, simplified):
#   nothing: linear in its inputs with a backward that needs only shapes;
#   output:  the backward is written in terms of the result (softmax, tanh, ...);
#   inputs+output: attention kernels (q, k, v, out, logsumexp);
#   mask:    dropout keeps a one-byte mask per element;
#   products (below) keep an operand when another operand needs a gradient;
#   any other op keeps its non-parameter tensor inputs (conv keeps the activation for the
#   weight gradient, gelu/layer_norm/cross_entropy/div keep their inputs).
_SAVES_NOTHING = frozenset(
    {
        "add",
        "sub",
        "neg",
        "sum",
        "mean",
        "cat",
        "stack",
        "clone",
        "contiguous",
        "reshape",
        "view",
        "expand",
        "pad",
        "constant_pad_nd",
        "slice",
        "select",
        "to",
        "_to_copy",
        "copy",
        "permute",
        "transpose",
        "t",
        "flatten",
        "unflatten",
        "unsqueeze",
        "squeeze",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "alias",
        "repeat",
        "roll",
        "flip",
        "lift_fresh_copy",
        "type_as",
        "_unsafe_view",
    }
)
_SAVES_OUTPUT = frozenset(
    {"softmax", "_softmax", "log_softmax", "_log_softmax", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "relu", "elu"}
)
_SAVES_INPUTS_AND_OUTPUT = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "flash_attention",
    }
)
_SAVES_MASK = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
# Products keep each operand only for another operand's gradient (x * 0.5 keeps nothing; q * cos,
# with cos a constant, keeps cos but not q).
_PRODUCTS = frozenset({"mul", "mm", "bmm", "matmul", "addmm", "linear", "baddbmm", "addbmm"})


class ParamArrays(NamedTuple):
    """The parameter axis ``p`` of a CostTable, ordered by first use, then name."""

    names: tuple[str, ...]
    num_bytes: np.ndarray  # int64[p], bytes in the parameter's own dtype
    trainable: np.ndarray  # bool[p], gets a gradient and optimizer state
    uses: tuple[np.ndarray, ...]  # int64 sorted node positions reading p


# ----------------------------------------------------------------------------- node classes


def op_name(target: str) -> str:
    """The op's name without namespace and overload: "aten.add_.Tensor" -> "add_"."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def is_inplace(node: OpNode) -> bool:
    """An in-place aten op ("add_", "masked_fill_"): capture marks it a view, but it does work."""
    name = op_name(node.target)
    return node.target.startswith("aten.") and name.endswith("_") and not name.endswith("__")


def costs_nothing(node: OpNode) -> bool:
    """Views, symbolic-size ops and metadata asserts: no kernel runs, no time is spent."""
    return not node.outputs or (node.is_view and not is_inplace(node))


def _is_float(node: OpNode) -> bool:
    return any(t.dtype in FLOAT_DTYPES for t in node.outputs)


# ----------------------------------------------------------------------------- bytes


def compute_dtype(dtype: str, precision: Precision = Precision.FP32) -> str:
    """The dtype a captured value of ``dtype`` has when the graph runs in ``precision``."""
    return "bfloat16" if precision is Precision.BF16 and dtype == "float32" else dtype


def tensor_bytes(
    tensor: TensorInfo, microbatch_size: int, example_batch_size: int, precision: Precision = Precision.FP32
) -> int:
    """Bytes of ``tensor`` at ``microbatch_size``, in ``precision`` (halved: float32 under bf16)."""
    num_bytes = tensor.bytes_at_batch(microbatch_size, example_batch_size)
    if compute_dtype(tensor.dtype, precision) != tensor.dtype:
        return num_bytes // 2
    return num_bytes


def value_bytes(
    graph: OpGraph, microbatch_size: int, precision: Precision = Precision.FP32, shards: np.ndarray | None = None
) -> np.ndarray:
    """int64[n]: bytes of every tensor output of node n, scaled, in ``precision``; views included.

    ``shards[n]``: the number of parts node n's values are split into, of which one device holds
    one (a tensor-parallel group's split nodes; ``partita.cost.tensor_parallel``); None: whole.
    The same sums as ``tensor_bytes`` over each node's outputs, over arrays of every output."""
    node, num_bytes, batched, halved = _output_tensors(graph, precision)
    scaled = np.where(batched, num_bytes * microbatch_size // graph.batch_size, num_bytes)
    scaled = np.where(halved, scaled // 2, scaled)
    values = np.zeros(graph.num_nodes, dtype=np.int64)
    np.add.at(values, node, scaled)
    return values if shards is None else -(-values // np.asarray(shards, dtype=np.int64))


@graph_memo
def _output_tensors(graph: OpGraph, precision: Precision) -> tuple[np.ndarray, ...]:
    """(node, bytes at the example batch, has a batch dim, halved in ``precision``) of every
    tensor output of the graph, one entry per tensor (a graph is immutable: computed once)."""
    rows = [
        (n.index, t.num_bytes, t.batch_dim is not None, compute_dtype(t.dtype, precision) != t.dtype)
        for n in graph.nodes
        for t in n.outputs
    ]
    node, num_bytes, batched, halved = (np.array(column) for column in zip(*rows)) if rows else ([],) * 4
    return (
        np.asarray(node, dtype=np.int64),
        np.asarray(num_bytes, dtype=np.int64),
        np.asarray(batched, dtype=bool),
        np.asarray(halved, dtype=bool),
    )


def output_bytes(
    graph: OpGraph, microbatch_size: int, precision: Precision = Precision.FP32, shards: np.ndarray | None = None
) -> np.ndarray:
    """int64[n]: bytes of new memory node n's outputs take, scaled (0 for views and in-place ops);
    ``shards`` as ``value_bytes`` takes it."""
    values = value_bytes(graph, microbatch_size, precision, shards)
    views = np.array([n.is_view for n in graph.nodes], dtype=bool)
    return np.where(views, 0, values)


def cut_bytes(
    graph: OpGraph, microbatch_size: int, precision: Precision = Precision.FP32, shards: np.ndarray | None = None
) -> np.ndarray:
    """int64[num_nodes + 1]: bytes of every value produced before cut c and read at or after it.

    A value is sent across a stage boundary as it is (the runtime clones boundary views to
    contiguous memory), so each crossing value counts its own bytes, views included. A value of
    node i whose last reader is node j crosses cuts i+1 .. j; one sweep over a difference array
    adds it to all of them in O(num_nodes + num_edges). Graph inputs are excluded (every rank
    has the batch); values nobody reads (graph outputs other than through nodes) cross nothing.
    ``shards`` as ``value_bytes`` takes it (a device sends its own part of a split value).
    """
    num_nodes = graph.num_nodes
    values = value_bytes(graph, microbatch_size, precision, shards)
    diff = np.zeros(num_nodes + 2, dtype=np.int64)
    for node in graph.nodes:
        if node.consumers and values[node.index]:
            last = max(node.consumers)
            diff[node.index + 1] += values[node.index]
            diff[last + 1] -= values[node.index]
    return np.cumsum(diff)[: num_nodes + 1]


class BlockBytes(NamedTuple):
    """A CostTable's block arrays (``CostTable`` documents them)."""

    block_ranges: np.ndarray  # int64[L, 2]
    block_input_bytes: np.ndarray  # int64[L]
    block_output_bytes: np.ndarray  # int64[L]


def block_bytes(
    graph: OpGraph, microbatch_size: int, precision: Precision = Precision.FP32, shards: np.ndarray | None = None
) -> BlockBytes:
    """The block arrays of ``graph`` at ``microbatch_size``: each block's range, the values made
    since the previous block's start and read from its start on, and those it makes and passes
    on; ``shards`` as ``value_bytes`` takes it (a device keeps its own part of a split value)."""
    blocks = graph.blocks
    ranges = np.array([(b.start, b.stop) for b in blocks], dtype=np.int64).reshape(-1, 2)
    values = value_bytes(graph, microbatch_size, precision, shards)
    last = np.array([max(n.consumers) if n.consumers else -1 for n in graph.nodes], dtype=np.int64)
    made = np.arange(graph.num_nodes)
    inputs, outputs = [], []
    for k, (start, stop) in enumerate(ranges):
        since = ranges[k - 1][0] if k else 0
        inputs.append(values[(made >= since) & (made < start) & (last >= start)].sum())
        outputs.append(values[(made >= start) & (made < stop) & (last >= stop)].sum())
    return BlockBytes(ranges, np.array(inputs, dtype=np.int64), np.array(outputs, dtype=np.int64))


@graph_memo
def storage_roots(graph: OpGraph) -> tuple[int | None, ...]:
    """Per node, the root whose memory its value lives in: a node index, ``-(j + 1)`` for graph
    input j, or None for a view of a parameter or constant (nobody's activation). Remembered per
    graph (graphs are immutable), as ``requires_grad`` is."""
    roots: list[int | None] = []
    for node in graph.nodes:
        if not node.is_view:
            roots.append(node.index)
            continue
        source = next((p for p in node.inputs if graph.nodes[p].outputs), None)
        if source is not None:
            roots.append(roots[source])
        elif node.graph_inputs:
            roots.append(-(node.graph_inputs[0] + 1))
        else:
            roots.append(None)
    return tuple(roots)


# ----------------------------------------------------------------------------- gradients


@graph_memo
def requires_grad(graph: OpGraph) -> np.ndarray:
    """bool[n]: whether node n's value gets a gradient (so node n has a backward).

    True when n has a floating-point output and reads a trainable parameter or a value that
    requires grad; graph inputs (the data) never do.
    """
    trainable = {name for name, p in graph.parameters.items() if p.requires_grad and not p.is_buffer}
    result = np.zeros(graph.num_nodes, dtype=bool)
    for node in graph.nodes:
        if not _is_float(node) or op_name(node.target) in _NO_GRAD_OPS:
            continue
        result[node.index] = any(p in trainable for p in node.params) or any(result[i] for i in node.inputs)
    result.flags.writeable = False  # remembered per graph: shared by every caller
    return result


def activation_bytes(
    graph: OpGraph,
    microbatch_size: int,
    precision: Precision = Precision.FP32,
    shards: np.ndarray | None = None,
    skip: np.ndarray | None = None,
) -> np.ndarray:
    """int64[n]: bytes node n keeps alive for its backward, scaled.

    Which tensors an op keeps follows the tables above. A kept view keeps its whole storage
    root alive, so the root's bytes count, and each root counts once, at the first node that
    keeps it (softmax keeps its output and the next matmul keeps the same memory). Nodes
    without a backward (no grad, views, in-place ops, integer outputs) keep nothing. ``shards``
    as ``value_bytes`` takes it: a kept root counts the part of it one device holds. ``skip``
    (bool[n]): the roots of these nodes count nothing (kept elsewhere: selective recomputation's
    saved outputs, ``partita.cost.recompute``).
    """
    values = value_bytes(graph, microbatch_size, precision, shards)
    b = graph.batch_size
    input_bytes = np.array(
        [tensor_bytes(g.tensor, microbatch_size, b, precision) if g.tensor is not None else 0 for g in graph.inputs]
        + [0],
        dtype=np.int64,
    )
    keeper, kind, index, itemsize = _first_keepers(graph, precision)
    node_values = values[np.where(kind == _INPUT, 0, index)] // itemsize
    kept = np.where(kind == _INPUT, input_bytes[np.where(kind == _INPUT, index, -1)], node_values)
    if skip is not None:
        kept = np.where((kind == _NODE) & np.asarray(skip, dtype=bool)[index], 0, kept)
    result = np.zeros(graph.num_nodes, dtype=np.int64)
    np.add.at(result, keeper, kept)
    return result


def backward_read_bytes(graph: OpGraph, microbatch_size: int, precision: Precision = Precision.FP32) -> np.ndarray:
    """int64[n]: bytes of the tensors node n's backward reads back from its forward, scaled.

    The same tensors as ``activation_bytes`` (the tables above), but each node counts all of its
    own, also those another node already keeps alive: this is memory traffic, not memory held
    (the analytic model's backward, ``partita.cost.analytic``)."""
    roots = storage_roots(graph)
    grad = requires_grad(graph)
    trainable = {name for name, p in graph.parameters.items() if p.requires_grad and not p.is_buffer}
    values = value_bytes(graph, microbatch_size, precision)
    input_bytes = [
        tensor_bytes(g.tensor, microbatch_size, graph.batch_size, precision) if g.tensor is not None else 0
        for g in graph.inputs
    ]

    def root_bytes(root, itemsize: int) -> int:
        if isinstance(root, tuple):  # a dropout mask: one byte per element of the node's value
            return int(values[root[1]]) // itemsize
        return int(values[root]) if root >= 0 else input_bytes[-root - 1]

    result = np.zeros(graph.num_nodes, dtype=np.int64)
    for node in graph.nodes:
        if grad[node.index] and not node.is_view:
            kept = _kept_tensors(node, roots, grad, trainable, precision)
            result[node.index] = sum(root_bytes(root, itemsize) for root, itemsize in kept if root is not None)
    return result


_NODE, _INPUT, _MASK = 0, 1, 2  # kinds of storage root: a node's value, a graph input, a dropout mask


@graph_memo
def _first_keepers(graph: OpGraph, precision: Precision) -> tuple[np.ndarray, ...]:
    """(keeper, kind, index, itemsize) of every storage root some node keeps for its backward, at the
    first node that keeps it (``activation_bytes``): the keeping node; ``_NODE`` (index: the node
    whose value it is), ``_INPUT`` (index: the graph input) or ``_MASK`` (index: the dropout node;
    one byte per element of its value, whose itemsize divides it). Which roots are kept does not
    depend on the micro-batch size, so a graph's are found once (graphs are immutable)."""
    roots = storage_roots(graph)
    grad = requires_grad(graph)
    trainable = {name for name, p in graph.parameters.items() if p.requires_grad and not p.is_buffer}
    seen: set = set()
    rows: list[tuple[int, int, int, int]] = []
    for node in graph.nodes:
        if not grad[node.index] or node.is_view:
            continue
        for root, itemsize in _kept_tensors(node, roots, grad, trainable, precision):
            if root is None or root in seen:
                continue
            seen.add(root)
            if isinstance(root, tuple):
                rows.append((node.index, _MASK, root[1], itemsize))
            else:
                rows.append((node.index, _NODE, root, 1) if root >= 0 else (node.index, _INPUT, -root - 1, 1))
    columns = [np.array(c, dtype=np.int64) for c in zip(*rows)] if rows else [np.zeros(0, dtype=np.int64)] * 4
    return tuple(columns)


def _kept_tensors(node: OpNode, roots: list, grad: np.ndarray, trainable: set, precision: Precision) -> list[tuple]:
    """(storage root, the itemsize dividing its bytes) of each tensor ``node`` keeps for its backward:
    1, but a dropout mask's (one byte per element of the output)."""
    name = op_name(node.target)
    own = roots[node.index]
    if name in _SAVES_NOTHING:
        return []
    if name in _SAVES_MASK:  # one byte per element of the output
        return [(("mask", node.index), _ITEMSIZE.get(compute_dtype(node.outputs[0].dtype, precision), 4))]
    if name in _SAVES_OUTPUT:
        return [(own, 1)]
    # (storage root, requires grad) of each non-parameter operand; graph inputs never need grad.
    operands = [(roots[p], bool(grad[p])) for p in node.inputs] + [(-(j + 1), False) for j in node.graph_inputs]
    if name in _PRODUCTS:
        # d(x·y)/dx needs y and d(x·y)/dy needs x: keep an operand iff another one needs a gradient.
        weight_grad = any(p in trainable for p in node.params)
        grads = [g for _, g in operands]
        kept = [(r, 1) for k, (r, _) in enumerate(operands) if weight_grad or any(grads[:k]) or any(grads[k + 1 :])]
    else:
        kept = [(r, 1) for r, _ in operands]
    if name in _SAVES_INPUTS_AND_OUTPUT:
        kept.append((own, 1))
    return kept


# ----------------------------------------------------------------------------- parameters


def param_arrays(graph: OpGraph) -> ParamArrays:
    """Parameters and buffers in a fixed order (first reading node, then name; unread ones last)."""
    uses: dict[str, list[int]] = {name: [] for name in graph.parameters}
    for node in graph.nodes:
        for name in node.params:
            if name in uses:
                uses[name].append(node.index)
    order = sorted(graph.parameters, key=lambda name: (uses[name][0] if uses[name] else graph.num_nodes, name))
    infos = [graph.parameters[name] for name in order]
    return ParamArrays(
        names=tuple(order),
        num_bytes=np.array([p.num_bytes for p in infos], dtype=np.int64),
        trainable=np.array([p.requires_grad and not p.is_buffer for p in infos], dtype=bool),
        uses=tuple(np.array(sorted(set(uses[name])), dtype=np.int64) for name in order),
    )


def contended(costs: CostTable, slowdown: float) -> CostTable:
    """``costs`` with its compute times at ``slowdown`` times the solo profile's.

    Ranks that share one machine's caches and memory bandwidth compute slower together than
    alone (``Cluster.compute_slowdown``, measured by ``local_machine.measure_contention``);
    a profile measures one process alone. Idempotent: a table already slowed
    (``calibration["compute_slowdown"]``) is rescaled, never slowed twice; the same table comes
    back when nothing changes."""
    factor = slowdown / costs.calibration.get("compute_slowdown", 1.0)
    if factor == 1.0:
        return costs
    return dataclasses.replace(
        costs,
        forward_s=costs.forward_s * factor,
        backward_s=costs.backward_s * factor,
        backward_weight_s=costs.backward_weight_s * factor,
        selective_recompute_s=costs.selective_recompute_s * factor,
        split_backward_s=costs.split_backward_s * factor,
        calibration={**costs.calibration, "compute_slowdown": float(slowdown)},
    )

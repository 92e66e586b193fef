"""Costs of one device of a tensor-parallel group: a CostTable for degree ``t`` from one for degree 1.

A ``TensorParallelLayout`` (``partita.types.tensor_parallel``, found on the graph by
``partita.capturing.tensor_parallel``) says which nodes a group of ``t`` devices splits and which
all-reduces that costs. Each device of the group then runs, per micro-batch:

    time      a node of ``sharded_nodes`` (its work splits): forward_s, backward_s and
              backward_weight_s / t;
              plus, after node n's forward, the ring all-reduce of ``forward_reductions[n]``
              elements over the group (in forward_s[n]), and in its backward the all-reduce of
              ``backward_reductions[n]`` + ``backward_fixed_reductions[n]`` elements (in
              backward_s[n], the input-gradient part:
              backward_weight_s is unchanged). A ring all-reduce of b bytes over t devices of one
              node takes 2 (t - 1) α + 2 (t - 1)/t · b / β on the intra-node link
              (``partita.cost.comm``).
    bytes     the values of sharded nodes are 1/t of their size: a device holds one part of each
              (``partita.cost.table``'s ``shards``), except the outputs the group all-reduces in the
              forward, whole again (``split_values``). Output bytes and cut bytes follow (a split
              value crosses a stage boundary as one part per device: tensor-parallel index i of a
              stage sends to index i of the next), and so do the activation bytes kept, per
              storage root: a replicated value a split node keeps (the input of a
              column-parallel matmul) keeps its whole size.
    params    a parameter of ``layout.params`` holds 1/t of its bytes on each device; its
              gradient and optimizer state follow in the memory model (``partita.cost.memory``).

Sequence parallelism (``layout.sequence_parallel``) also splits the regions between, by token:
the values and work of ``sequence_nodes`` divide by ``t`` too, except the copies gathered whole for
column-parallel matmuls (``gathered_nodes``: those matmuls keep that copy for their backward).
A row-parallel matmul's partial output is whole until it is reduce-scattered, but nothing keeps
it: backward does not read it, and selective recomputation keeps the matmul fused with its
reduce-scatter (``partita.runtime.tensor_parallel_ops.matmul_reduce_scatter``), i.e. this
device's tokens of the sum, and runs neither again. A column-parallel matmul that alone reads a
gathered value (``layout.fused_gathers``) runs fused with that all-gather
(``all_gather_matmul``) where its blocks run around the ring: it keeps the value's token part for
backward, where it gathers it again while the input gradient's product is formed (the second of
its ``layout.backward_passes``, overlapped: ``partita.cost.collective_matmul``) and reduce-scatters
that product while the weight gradient is formed (not so in a zero-bubble schedule's input pass:
``split_backward_s``), and selective
recomputation runs neither again. Where its blocks are smaller the two run apart, as above (the
matmul keeps the gathered value whole, its backward only reduce-scatters, selective
recomputation gathers again); its collectives are still counted at the matmul. Sequence
parallelism's collectives are single ring passes, ``t - 1`` steps of ``b / t`` bytes each,
``(t - 1) α + (t - 1)/t · b / β`` (``layout.forward_passes`` / ``backward_passes``), which replace
the all-reduces of the row-parallel outputs and column-parallel inputs. A token-split value
crosses a stage boundary as each device's tokens (``cut_bytes``; the runtime's ``boundary_parts``),
where the next stage has the same degree; to another degree it travels whole (``whole_cut_bytes``).

Every device of the group runs the same work, so one table describes each of them. Reduction
counts are elements at the graph's example batch size; they are activations (the output of a
row-parallel matmul, the input gradient of column-parallel ones, three values per row of a
vocab-parallel loss), so they scale with the micro-batch, but for the gradients of whole
operands without a batch dimension (``backward_fixed_reductions``: a weight broadcast over the
tokens that something else reads too, T5's position bias) and the gradient passes of such operands
scattered by token (``backward_fixed_passes``), the same at every micro-batch size; all move in the
compute dtype (2 bytes under bf16, 4 under fp32). A weight only ever broadcast over the tokens (a
norm's weight and bias, a row-parallel bias) has its gradient summed over the group once per step
by the trainer (``partita.runtime.tensor_parallel_rewrite.partial_gradients``): one all-reduce of
a few vectors per rank, not counted (530B's rank of five layers: 2.5 MB of fp32 gradients, under
0.1 ms of a 36 s step). Measured activation bytes (the profiler's) are scaled node by node by
the modelled bytes with the split over those without.

The division of times is the roofline's: a node's work, its fixed per-kernel overhead included,
splits evenly; smaller matmuls reaching a lower share of the peak is not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import numpy as np

from partita.cost import comm
from partita.cost.collective_matmul import decomposes, fused_column_seconds, fused_row_seconds
from partita.cost.recompute import kept_mask, selective_arrays
from partita.cost.table import activation_bytes, block_bytes, cut_bytes, output_bytes, storage_roots, value_bytes
from partita.errors import InputError
from partita.types import Cluster, CostTable, OpGraph, Precision
from partita.types.devices import resolve_device
from partita.types.tensor_parallel import TensorParallelLayout

__all__ = ["reduction_times_s", "split_values", "tensor_parallel_costs"]


def tensor_parallel_costs(
    costs: CostTable, graph: OpGraph, layout: TensorParallelLayout, cluster: Cluster
) -> CostTable:
    """``costs`` (degree 1, of ``graph``) as one device of a group of ``layout.degree`` devices
    (module docstring); the same table for degree 1 or a trivial layout. The all-reduces run on
    ``cluster``'s intra-node link: a group never spans nodes. InputError when the layout names
    nodes or parameters ``graph`` lacks (a layout found on another graph)."""
    t = layout.degree
    if t == 1 or layout.is_trivial:
        return costs
    if costs.tensor_parallel != 1:
        raise InputError(
            f"the cost table is for tensor-parallel degree {costs.tensor_parallel} already: pass degree 1's"
        )
    position = _positions(graph, layout, costs.param_names)
    split = np.zeros(graph.num_nodes, dtype=bool)
    split[[position[name] for name in layout.sharded_nodes | layout.sequence_nodes if name in position]] = True
    shards = np.where(split, t, 1)  # the work
    tensor_parts = np.where(split_values(graph, layout), t, 1)  # the values tensor parallelism splits
    b, precision = costs.microbatch_size, Precision.parse(costs.precision)
    rows, columns = _fused_rows(graph, layout), _fused_columns(graph, layout)
    flops = np.array([n.flops for n in graph.nodes], dtype=np.float64) * b / graph.batch_size
    whole_output = output_bytes(graph, b, precision)
    gathered_input = _gathered_input_bytes(graph, layout, b, precision)
    # one device's share of the work, one token block of it, and what a ring step sends
    row_ring = rows & decomposes(flops / (t * t), whole_output / t)
    column_ring = columns & decomposes(flops / (t * t), gathered_input / t)
    kept_whole = layout.gathered_nodes | {g for g, m in layout.fused_gathers.items() if not column_ring[position[m]]}
    parts = _token_parts(graph, layout, tensor_parts, kept_whole)
    sent_parts = _sent_parts(graph, layout, tensor_parts)
    forward_ar, backward_ar = reduction_times_s(costs, graph, layout, cluster)
    held = activation_bytes(graph, b, precision, parts)
    if costs.source != "analytic":  # measured: scaled by the modelled share, node by node
        whole = np.asarray(activation_bytes(graph, b, precision), dtype=np.float64)
        kept = np.asarray(costs.activation_bytes, dtype=np.float64)
        ratio = np.divide(held, whole, out=1.0 / parts, where=whole > 0)
        held = np.where(whole > 0, np.round(kept * ratio), np.ceil(kept * ratio)).astype(np.int64)
    # Selective recomputation keeps the parts of the kept outputs, and runs the group's forward
    # collectives again (each follows a kept matmul, whose output is not recomputed: added apart),
    # but for the reduce-scatters fused with their row-parallel matmuls, kept as one op.
    measured = None if costs.source == "analytic" else held
    selective = selective_arrays(graph, b, costs.forward_s, precision, parts, measured)
    rerun = np.where(rows | column_ring, 0.0, forward_ar)  # small column blocks: the gather runs apart
    forward_s, backward_s = np.asarray(costs.forward_s) / shards, np.asarray(costs.backward_s) / shards
    backward_weight_s = np.asarray(costs.backward_weight_s) / shards
    forward_added, backward_added = forward_ar, backward_ar  # the collectives, serial
    split_backward = np.zeros(graph.num_nodes)
    rings = dict(
        forward_s=forward_s,
        backward_s=backward_s,
        backward_weight_s=backward_weight_s,
        forward_ring_s=forward_ar,
        backward_ring_s=backward_ar,
        output_block_bytes=whole_output / t,
        contiguous=_contiguous_blocks(graph, layout, b),
        degree=t,
        device=resolve_device(cluster.device),
    )
    if row_ring.any():  # those of the matmuls run around the ring overlap their blocks
        fused = fused_row_seconds(**rings, input_block_bytes=_input_bytes(graph, b, precision, tensor_parts) / t)
        forward_added = np.where(row_ring, fused.forward, forward_added)
        backward_added = np.where(row_ring, fused.backward, backward_added)
    if columns.any():  # a block of a column-parallel output: this device's tokens and features
        fused = fused_column_seconds(**dict(rings, output_block_bytes=whole_output / (t * t)))
        forward_added = np.where(column_ring, fused.forward, forward_added)
        # where they run whole they keep the gathered input: their backward reduce-scatters alone
        backward_added = np.where(column_ring, fused.backward, np.where(columns, backward_ar / 2, backward_added))
        split_backward = np.where(column_ring, fused.split, 0.0)
    split_params = np.array([name in layout.params for name in costs.param_names], dtype=bool)
    param_bytes = np.asarray(costs.param_bytes, dtype=np.int64)
    return dataclasses.replace(
        costs,
        forward_s=forward_s + forward_added,
        backward_s=backward_s + backward_added,
        backward_weight_s=backward_weight_s,
        activation_bytes=held,
        output_bytes=output_bytes(graph, b, precision, parts),
        cut_bytes=cut_bytes(graph, b, precision, sent_parts),
        whole_cut_bytes=cut_bytes(graph, b, precision, tensor_parts),
        **block_bytes(graph, b, precision, sent_parts)._asdict(),
        param_bytes=np.where(split_params, -(-param_bytes // t), param_bytes),
        tensor_parallel=t,
        saved_bytes=selective.saved_bytes,
        recomputed_bytes=selective.recomputed_bytes,
        selective_recompute_s=np.asarray(costs.selective_recompute_s) / shards + rerun,
        split_backward_s=split_backward,
    )


def split_values(graph: OpGraph, layout: TensorParallelLayout) -> np.ndarray:
    """bool[n]: whether each device holds only a part of node n's value, split by tensor parallelism
    (along features or heads): the nodes of ``sharded_nodes`` except those whose output the group
    reduces in the forward (``forward_reductions``: a row-parallel matmul's or a vocab-parallel
    embedding's output is whole again, though their work is split; under sequence parallelism
    reduce-scattered by token, ``sequence_nodes``)."""
    reduced = set(layout.forward_reductions) | (layout.sharded_nodes & layout.sequence_nodes)
    return np.array([n.name in layout.sharded_nodes and n.name not in reduced for n in graph.nodes], dtype=bool)


def _sent_parts(graph: OpGraph, layout: TensorParallelLayout, tensor_parts: np.ndarray) -> np.ndarray:
    """Parts of each node's value a device sends to the next stage at a cut after it: under sequence
    parallelism its tokens of a token-split value (``partita.runtime.tensor_parallel.boundary_parts``:
    stages of one degree exchange those in part), the whole of any other (tensor parallelism's split
    values never cross a legal cut)."""
    if not layout.sequence_parallel:
        return tensor_parts
    tokens = np.array([n.name in layout.sequence_nodes for n in graph.nodes], dtype=bool)
    return np.where(tokens, layout.degree, tensor_parts)


def _token_parts(
    graph: OpGraph, layout: TensorParallelLayout, tensor_parts: np.ndarray, kept_whole: Collection[str]
) -> np.ndarray:
    """Parts of each node's value a device holds: ``tensor_parts`` and the token-split values, except
    the storage of the values gathered whole that are kept so (``kept_whole``: those gathered for
    column-parallel matmuls or operations that run whole, and the inputs of fused column-parallel
    matmuls whose blocks run whole)."""
    if not layout.sequence_parallel:
        return tensor_parts
    tokens = np.array([n.name in layout.sequence_nodes for n in graph.nodes], dtype=bool)
    parts = np.where(tokens, layout.degree, tensor_parts)
    roots = storage_roots(graph)
    for n in graph.nodes:
        if n.name in kept_whole and roots[n.index] is not None and roots[n.index] >= 0:
            parts[roots[n.index]] = 1
    return parts


def _fused_rows(graph: OpGraph, layout: TensorParallelLayout) -> np.ndarray:
    """bool[n]: the row-parallel matmuls the runtime runs fused with their reduce-scatter (under
    sequence parallelism: ``sharded_nodes`` whose output is token-split, and matmuls), which
    selective recomputation keeps as one op, running neither again, and whose collectives overlap
    their blocks where those are large enough (``partita.cost.collective_matmul``)."""
    if not layout.sequence_parallel:
        return np.zeros(graph.num_nodes, dtype=bool)
    rows = np.array([n.name in layout.sharded_nodes and n.name in layout.sequence_nodes for n in graph.nodes])
    return rows & kept_mask(graph)


def _fused_columns(graph: OpGraph, layout: TensorParallelLayout) -> np.ndarray:
    """bool[n]: the column-parallel matmuls that alone read their gathered input (``layout.fused_gathers``),
    whose collectives are counted at them; the runtime runs those whose blocks are large enough fused
    with the all-gather, around the ring (selective recomputation then runs neither again)."""
    matmuls = set(layout.fused_gathers.values())
    return np.array([n.name in matmuls for n in graph.nodes], dtype=bool)


def _contiguous_blocks(graph: OpGraph, layout: TensorParallelLayout, microbatch_size: int) -> np.ndarray:
    """bool[n]: whether a token block of each fused matmul's output (``layout.token_splits``) is
    contiguous at ``microbatch_size``: every dim before its tokens' part of size 1 (the tokens of
    one sequence, not of several), where the runtime's ring reads and writes blocks in place
    (``partita.runtime.collective_matmul.matmul_into``)."""
    out = np.zeros(graph.num_nodes, dtype=bool)
    position = {n.name: n.index for n in graph.nodes}
    for name, (dim, inner) in layout.token_splits.items():
        if name not in position or not graph.nodes[position[name]].outputs:
            continue
        shape = graph.nodes[position[name]].outputs[0].shape_at_batch(microbatch_size, graph.batch_size)
        out[position[name]] = math.prod(shape[:dim]) * (shape[dim] // inner) == 1
    return out


def _gathered_input_bytes(
    graph: OpGraph, layout: TensorParallelLayout, microbatch_size: int, precision: Precision
) -> np.ndarray:
    """float64[n]: the whole bytes of the input each fused column-parallel matmul all-gathers (0 elsewhere)."""
    out = np.zeros(graph.num_nodes)
    if not layout.fused_gathers:
        return out
    position = {n.name: n.index for n in graph.nodes}
    values = value_bytes(graph, microbatch_size, precision)
    for gathered, matmul in layout.fused_gathers.items():
        if gathered in position and matmul in position:
            out[position[matmul]] = float(values[position[gathered]])
    return out


def _input_bytes(graph: OpGraph, microbatch_size: int, precision: Precision, parts: np.ndarray) -> np.ndarray:
    """float64[n]: bytes one device holds of each node's first input (0 for none), ``parts`` as
    ``partita.cost.table.value_bytes`` takes ``shards``."""
    values = value_bytes(graph, microbatch_size, precision, parts)
    return np.array([float(values[n.inputs[0]]) if n.inputs else 0.0 for n in graph.nodes])


def reduction_times_s(
    costs: CostTable, graph: OpGraph, layout: TensorParallelLayout, cluster: Cluster
) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per node of the group's collectives at ``costs``' micro-batch
    size and precision (float64[n] each; 0 where a node communicates nothing): its all-reduces (two
    ring passes each) and sequence parallelism's reduce-scatters and all-gathers (one each)."""
    position = _positions(graph, layout, costs.param_names)
    itemsize = 2 if Precision.parse(costs.precision) is Precision.BF16 else 4
    scale = costs.microbatch_size / graph.batch_size
    latency_s, per_byte_s = comm.ring_pass_coefficients(layout.degree, cluster, spans_nodes=False)
    times = []
    for reductions, passes, fixed_reductions, fixed_passes in (
        (layout.forward_reductions, layout.forward_passes, {}, {}),
        (
            layout.backward_reductions,
            layout.backward_passes,
            layout.backward_fixed_reductions,
            layout.backward_fixed_passes,
        ),
    ):
        seconds = np.zeros(graph.num_nodes)
        for sums, each_pass, factor in ((reductions, passes, scale), (fixed_reductions, fixed_passes, 1.0)):
            for name, elements in sums.items():
                if name in position:
                    seconds[position[name]] += 2 * (latency_s + per_byte_s * elements * factor * itemsize)
            for name, each in each_pass.items():
                if name in position:
                    seconds[position[name]] += sum(latency_s + per_byte_s * e * factor * itemsize for e in each)
        times.append(seconds)
    return times[0], times[1]


def _positions(graph: OpGraph, layout: TensorParallelLayout, param_names: tuple[str, ...]) -> dict[str, int]:
    """Node name -> position, for the operations the layout names. It may also name the graph's
    inputs (the batch: the input gradient of a column-parallel matmul that reads one is never
    computed, so its all-reduce never runs) and parameters' get_attr nodes, which cost nothing;
    InputError for any other name."""
    position = {n.name: n.index for n in graph.nodes}
    free = {i.name for i in graph.inputs} | set(graph.attr_to_param)
    nodes = set(layout.sharded_nodes) | set(layout.forward_reductions) | set(layout.backward_reductions)
    nodes |= set(layout.backward_fixed_reductions) | set(layout.backward_fixed_passes)
    nodes |= set(layout.sequence_nodes) | set(layout.forward_passes) | set(layout.backward_passes)
    missing = sorted(nodes - set(position) - free)
    unknown = sorted(set(layout.params) - set(param_names))
    if missing or unknown:
        what = f"nodes {missing[:3]}" if missing else f"parameters {unknown[:3]}"
        raise InputError(
            f"the tensor-parallel layout names {what} that the graph does not have: it was found on another "
            "graph; find the layout on this one (partita.capturing.tensor_parallel.find_layout)"
        )
    return position

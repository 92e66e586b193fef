"""Compiled blocks' costs: the operations between two matmuls run as fused kernels.

inductor (``torch.compile``) leaves matmuls, convolutions and attention to their library kernels
and fuses the operations between them -- elementwise ones, normalisations, softmax, the loss --
into a few generated kernels, each of which reads its inputs from memory once and writes only
the values read after it. An eager step runs one kernel per operation, each reading and writing
its own tensors, and pays a launch for each (``partita.cost.analytic``).

Glossary
--------
anchor      a node inductor runs as a library kernel: a matmul (``keeps_node``: linear, mm,
            addmm, a matmul with a weight), a batched matmul, a convolution, attention. Costed
            as in eager execution.
group       the nodes of a segment between two anchors (a segment: a block, or the nodes before
            or after the blocks: what one compiled function holds, ``partita.runtime.segments``);
            views inside it cost nothing, as before. A group is costed as one memory pass:

                bytes   = its inputs (values read from outside the group, the graph's inputs
                          and its parameters) + its outputs (values read after the group)
                forward = max(flops / rate, bytes / bandwidth) + kernels · op_overhead_s

            with one kernel per reduction it holds (a norm, a softmax, a sum: inductor ends a
            kernel at a reduction's result), at least one. Its backward reads its outputs'
            gradients and its inputs (the partitioner recomputes the elementwise operations
            from them rather than keeping their results), writes its inputs' and parameters'
            gradients, and launches a kernel per reduction plus one for the parameters'
            gradients (a sum over the batch).

A group's time is shared among its nodes in proportion to their eager times, so that the
per-node arrays of the cost table (and every sum over a node range) stay meaningful; a stage
cut inside a group gets its share of the group's time.

Activation memory stays eager's (``partita.cost.table.activation_bytes``): the memory
inductor's partitioner keeps is at most that, so the memory model stays an upper bound.
"""

from __future__ import annotations

import numpy as np

from partita.capturing.recompute import keeps_node
from partita.cost.table import costs_nothing, op_name, tensor_bytes, value_bytes
from partita.types import DeviceSpec, OpGraph, Precision

__all__ = ["fused_times", "fusion_groups"]

_ANCHOR_OPS = frozenset({"bmm", "baddbmm", "matmul", "einsum"})
_REDUCTION_OPS = frozenset(
    {
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        "_fused_rms_norm",
        "group_norm",
        "batch_norm",
        "softmax",
        "_softmax",
        "log_softmax",
        "_log_softmax",
        "cross_entropy_loss",
        "nll_loss",
        "nll_loss_forward",
        "sum",
        "mean",
        "var",
        "var_mean",
        "std",
        "amax",
        "max",
        "logsumexp",
        "norm",
        "linalg_vector_norm",
    }
)


def fusion_groups(graph: OpGraph) -> list[list[int]]:
    """The groups of ``graph`` (module docstring), each a list of node indices in graph order;
    anchors and nodes that cost nothing outside a group belong to none."""
    starts = {b.start for b in graph.blocks} | {b.stop for b in graph.blocks}
    groups: list[list[int]] = []
    current: list[int] = []
    for node in graph.nodes:
        if node.index in starts and current:
            groups.append(current)
            current = []
        if _is_anchor(graph, node):
            if current:
                groups.append(current)
            current = []
            continue
        if current or not costs_nothing(node):
            current.append(node.index)
    if current:
        groups.append(current)
    return [g for g in groups if not all(costs_nothing(graph.nodes[n]) for n in g)]


def fused_times(
    graph: OpGraph,
    microbatch_size: int,
    precision: Precision,
    device: DeviceSpec,
    work: dict[str, np.ndarray],
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    backward_weight_s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forward, backward and weight-gradient seconds per node of compiled blocks, from eager
    ones (``partita.cost.analytic``; ``work``: its per-node FLOPs, parameter bytes read, peak
    rates, gradient counts)."""
    values = value_bytes(graph, microbatch_size, precision)
    b = graph.batch_size
    input_bytes = [
        tensor_bytes(g.tensor, microbatch_size, b, precision) if g.tensor is not None else 0 for g in graph.inputs
    ]
    grad = work["requires_grad"]
    memory_rate = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    forward, backward, weight = forward_s.copy(), backward_s.copy(), backward_weight_s.copy()
    for group in fusion_groups(graph):
        members = set(group)
        nodes = [graph.nodes[n] for n in group]
        outside = {p for node in nodes for p in node.inputs if p not in members}
        read = sum(int(values[p]) for p in outside) + sum(
            input_bytes[j] for j in {j for node in nodes for j in node.graph_inputs}
        )
        params = float(work["params_read"][group].sum())
        written = sum(
            int(values[n.index]) for n in nodes if not n.consumers or any(c not in members for c in n.consumers)
        )
        flops = work["flops"][group]
        rate = float(work["peak_flops"][group].max()) * device.compute_efficiency
        reductions = sum(1 for n in nodes if op_name(n.target) in _REDUCTION_OPS)
        kernels = max(1, reductions)
        forward_time = (
            max(float(flops.sum()) / rate, (read + params + written) / memory_rate) + kernels * device.op_overhead_s
        )
        _share(forward, group, forward_time)
        if backward_s[group].sum() <= 0:
            continue
        trains = bool(work["k_weight"][group].any())
        gradients_out = sum(int(values[p]) for p in outside if grad[p]) + (params if trains else 0.0)
        moved = written + read + gradients_out
        k = work["k_input"][group] + work["k_weight"][group]
        backward_time = (
            max(float((k * flops).sum()) / rate, moved / memory_rate)
            + (kernels + (1 if trains else 0)) * device.op_overhead_s
        )
        eager = backward_s[group].copy()
        _share(backward, group, backward_time)
        weight[group] = np.where(
            eager > 0, backward_weight_s[group] * backward[group] / np.where(eager > 0, eager, 1), 0
        )
    return forward, backward, weight


def _share(times: np.ndarray, group: list[int], total: float) -> None:
    """``total`` spread over ``group``'s nodes in proportion to their present times (evenly over
    its nodes that cost something, when those are all zero)."""
    present = times[group]
    if present.sum() > 0:
        times[group] = total * present / present.sum()
    else:
        times[group] = total / len(group)


def _is_anchor(graph: OpGraph, node) -> bool:
    return keeps_node(graph, node) or op_name(node.target) in _ANCHOR_OPS

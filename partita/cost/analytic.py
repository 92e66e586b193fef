"""Analytic (roofline) costs: per-node times estimated for a device nobody here has.

For every node with work to do (views, symbolic-size ops and asserts cost nothing)::

    forward_s  = max(flops / (peak_flops[dtype] · compute_efficiency),
                     bytes_moved / (memory_bandwidth · memory_efficiency)) + op_overhead_s

the roofline model (Williams, Waterman & Patterson, CACM 2009): an op is bound by arithmetic
or by memory traffic, whichever takes longer. ``flops`` are FlopCounterMode's (matmul-like ops
only: every other op is memory-bound here, as it is on accelerators); ``bytes_moved`` is the
bytes the node reads (activations and parameters) plus the bytes it writes. An embedding
reads only the rows it gathers, so it moves about twice its output (plus the indices), not
its whole table.

Backward: a node has ``k = k_in + k_w`` gradient products, one per operand that needs a
gradient: ``k_in`` values that require grad, plus ``k_w = 1`` when it reads trainable
parameters. A matmul's gradient for each operand costs as much as the forward, so

    backward_s        = max(k · flops / (peak · eff), backward_bytes / (bw · eff)) + k · op_overhead_s
    backward_weight_s = backward_s · k_w / k

A linear layer gets 2× its forward FLOPs (input + weight gradient), the attention matmuls
(Q·Kᵀ, P·V) also 2× (both operands need gradients), a first layer whose input is data 1×.
The memory side is what autograd's kernels move (``_backward_bytes``): the output gradient
read, the tensors the forward saved for it read back (``partita.cost.table.backward_read_bytes``: a
softmax's or tanh's output, a layer norm's or gelu's input, a dropout mask; nothing for
``x * 0.5``), and a gradient written per input (and trainable parameter) that needs one. So
a softmax or gelu moves 1.5× its forward traffic, a scale ``x * c`` or a dropout about 1×. An
``add`` (a residual, an additive mask) runs no backward kernel at all -- autograd hands its
output gradient to both operands -- except a sum over the dims it broadcast an operand over; nor
do copies that only change the layout (``clone``, ``contiguous``, ``reshape``). A value read by
several nodes that need its gradient gets their gradients summed, one ``add`` (two reads, one
write) per extra reader, counted in the producing node's backward bytes (kept inside the
roofline's max, so that the time stays two terms and an overhead: ``bench/gpu/check.py`` refits
them; a matmul's sum then hides under its compute). Gathers (embeddings) keep twice their
forward traffic. The rule this replaces, twice the forward traffic for every op, over-counted
GPT's memory-bound backward by about half (on the attention scores of an eager GPT-2: 12
score-sized reads and writes where autograd moves 5), which made Megatron-LM's 1.7B layout on
A100s predict 1.23x the step the paper measured (1.07x with this count;
``bench/megatron_calibration.py``).

Precision: under ``Precision.BF16`` every node runs at the device's bfloat16 peak, and every
float32 value and parameter read counts at 2 bytes (bf16 parameter copies and activations,
``partita.cost.table``); ``param_bytes`` stay in the parameters' own dtype (the fp32 master
weights), which the memory model converts.

Micro-batch scaling: shapes are recorded at ``graph.batch_size``. Tensors with a batch dim
scale by ``microbatch_size / graph.batch_size``; parameters do not. A node's FLOPs scale when
any of its outputs has a batch dim.
"""

from __future__ import annotations

import numpy as np

from partita.checks import positive_int
from partita.cost.fusion import fused_times
from partita.cost.recompute import selective_arrays
from partita.cost.table import (
    FLOAT_DTYPES,
    activation_bytes,
    backward_read_bytes,
    block_bytes,
    compute_dtype,
    costs_nothing,
    cut_bytes,
    op_name,
    output_bytes,
    param_arrays,
    requires_grad,
    tensor_bytes,
    value_bytes,
)
from partita.errors import InputError
from partita.types import CostTable, DeviceSpec, OpGraph, OpNode, OptimizerKind, Precision
from partita.types.devices import resolve_device

__all__ = ["analytic_costs", "optimizer_step_s"]

_GATHER_OPS = frozenset({"embedding"})  # read only the rows they return
# Ops whose backward hands the output gradient to each operand as it is (a view of it): no kernel.
_GRADIENT_PASSES = frozenset({"add", "clone", "contiguous", "reshape", "_unsafe_view", "alias", "lift_fresh_copy"})


def analytic_costs(
    graph: OpGraph,
    device: DeviceSpec | str,
    microbatch_size: int,
    *,
    dtype: str | None = None,
    precision: Precision | str = Precision.FP32,
    compiled: bool = False,
) -> CostTable:
    """Roofline CostTable of ``graph`` at ``microbatch_size`` on ``device`` (spec or catalog name).

    ``precision`` is what the plan computes in: "bf16" costs every node at the bfloat16 peak and
    counts float32 values at 2 bytes (memory traffic, activations, cut bytes). ``dtype`` selects
    another ``device.peak_flops`` entry for every node (e.g. "tfloat32" for float32 matmuls run
    as TF32); by default each node uses its own output dtype in ``precision``. ``compiled``: the
    blocks run through torch.compile, the operations between two matmuls as fused kernels
    (``partita.cost.fusion``). Runs in well under a second for a graph of thousands of nodes.
    """
    device = resolve_device(device)
    microbatch_size = positive_int(microbatch_size, "microbatch_size")
    precision = Precision.parse(precision)
    work = _node_work(graph, microbatch_size, device, dtype, precision)
    compute_rate = work["peak_flops"] * device.compute_efficiency  # FLOP/s per node
    memory_rate = device.memory_bandwidth_bytes_per_s * device.memory_efficiency  # bytes/s
    busy = ~work["free"]

    forward_s = np.maximum(work["flops"] / compute_rate, work["bytes_moved"] / memory_rate) + device.op_overhead_s
    forward_s = np.where(busy, forward_s, 0.0)

    k_weight = work["k_weight"]
    k = work["k_input"] + k_weight
    has_backward = busy & work["requires_grad"] & (k > 0)
    moved = _backward_bytes(graph, microbatch_size, precision, work)
    runs = (work["flops"] > 0) | (moved > 0)  # an add or a layout copy runs no kernel: no launch either
    backward_s = np.maximum(k * work["flops"] / compute_rate, moved / memory_rate) + np.where(runs, k, 0) * (
        device.op_overhead_s
    )
    backward_s = np.where(has_backward, backward_s, 0.0)
    backward_weight_s = np.where(has_backward, backward_s * k_weight / np.maximum(k, 1), 0.0)
    if compiled:
        forward_s, backward_s, backward_weight_s = fused_times(
            graph, microbatch_size, precision, device, work, forward_s, backward_s, backward_weight_s
        )

    params = param_arrays(graph)
    selective = selective_arrays(graph, microbatch_size, forward_s, precision)
    return CostTable(
        microbatch_size=microbatch_size,
        device=device.name,
        source="analytic",
        precision=precision.value,
        forward_s=forward_s,
        backward_s=backward_s,
        backward_weight_s=backward_weight_s,
        activation_bytes=activation_bytes(graph, microbatch_size, precision),
        output_bytes=output_bytes(graph, microbatch_size, precision),
        cut_bytes=cut_bytes(graph, microbatch_size, precision),
        **block_bytes(graph, microbatch_size, precision)._asdict(),
        param_names=params.names,
        param_bytes=params.num_bytes,
        param_trainable=params.trainable,
        param_uses=params.uses,
        **selective._asdict(),
    )


def _node_work(
    graph: OpGraph, microbatch_size: int, device: DeviceSpec, dtype: str | None, precision: Precision
) -> dict[str, np.ndarray]:
    """Per node: scaled FLOPs and bytes moved, the peak FLOP/s of its dtype, gradient operand counts."""
    if dtype is not None and dtype not in device.peak_flops:
        raise InputError(
            f"dtype {dtype!r} is not in the peak_flops of device {device.name!r}: "
            f"choose one of {', '.join(sorted(device.peak_flops))}"
        )
    num_nodes, b = graph.num_nodes, graph.batch_size
    values = value_bytes(graph, microbatch_size, precision)
    grad = requires_grad(graph)
    input_bytes = [
        tensor_bytes(g.tensor, microbatch_size, b, precision) if g.tensor is not None else 0 for g in graph.inputs
    ]
    param_bytes = {  # as read by the op: bf16 copies of float32 parameters under bf16
        name: p.num_bytes // 2 if compute_dtype(p.dtype, precision) != p.dtype else p.num_bytes
        for name, p in graph.parameters.items()
    }
    trainable = {name for name, p in graph.parameters.items() if p.requires_grad and not p.is_buffer}
    names = ("flops", "bytes_moved", "params_read", "peak_flops", "k_input", "k_weight")
    work = {name: np.zeros(num_nodes) for name in names}
    work["free"] = np.zeros(num_nodes, dtype=bool)
    work["requires_grad"] = grad
    for node in graph.nodes:
        n = node.index
        work["peak_flops"][n] = _peak_flops(device, dtype or compute_dtype(_node_dtype(node), precision))
        if costs_nothing(node):
            work["free"][n] = True
            continue
        batched = any(t.batch_dim is not None for t in node.outputs)
        work["flops"][n] = node.flops * microbatch_size / b if batched else node.flops
        activations_read = sum(int(values[p]) for p in node.inputs) + sum(input_bytes[j] for j in node.graph_inputs)
        work["params_read"][n] = sum(param_bytes.get(name, 0) for name in node.params)
        if op_name(node.target) in _GATHER_OPS:  # rows read + output written + indices read
            work["bytes_moved"][n] = 2 * int(values[n]) + activations_read
        else:
            work["bytes_moved"][n] = activations_read + work["params_read"][n] + int(values[n])
        work["k_input"][n] = sum(1 for p in set(node.inputs) if grad[p])
        work["k_weight"][n] = 1 if any(name in trainable for name in node.params) else 0
    return work


def _backward_bytes(
    graph: OpGraph, microbatch_size: int, precision: Precision, work: dict[str, np.ndarray]
) -> np.ndarray:
    """float64[n]: the bytes node n's backward kernels move, summing the gradients of its readers
    included, as the module docstring counts them."""
    values = value_bytes(graph, microbatch_size, precision)
    saved = backward_read_bytes(graph, microbatch_size, precision)
    grad = work["requires_grad"]
    moved = np.zeros(graph.num_nodes)
    for node in graph.nodes:
        n = node.index
        if work["free"][n] or not grad[n]:
            continue
        needing = [p for p in set(node.inputs) if grad[p]]  # operands that get a gradient
        name = op_name(node.target)
        if name in _GATHER_OPS:
            moved[n] = 2.0 * work["bytes_moved"][n]
        elif name in _GRADIENT_PASSES:  # no kernel, but a sum over the dims an operand was broadcast over
            summed = [int(values[p]) for p in needing if values[p] < values[n]]
            summed += [work["params_read"][n]] if work["k_weight"][n] else []  # x + bias: the bias's gradient
            moved[n] = (int(values[n]) + sum(summed)) if summed else 0
        else:
            written = sum(int(values[p]) for p in needing) + work["k_weight"][n] * work["params_read"][n]
            moved[n] = int(values[n]) + int(saved[n]) + written
        readers = sum(1 for c in set(node.consumers) if grad[c])
        moved[n] += 3.0 * max(0, readers - 1) * int(values[n])  # views' readers: not counted
    return moved


def _node_dtype(node: OpNode) -> str:
    """The dtype a node computes in: its first floating-point output's ("float32" if none)."""
    return next((t.dtype for t in node.outputs if t.dtype in FLOAT_DTYPES), "float32")


def _peak_flops(device: DeviceSpec, dtype: str) -> float:
    """Peak FLOP/s for ``dtype``; dtypes the spec lacks (float64, int ops) use its float32 rate."""
    if dtype in device.peak_flops:
        return float(device.peak_flops[dtype])
    return float(device.peak_flops.get("float32", min(device.peak_flops.values())))


def optimizer_step_s(
    trainable_bytes: float,
    optimizer: OptimizerKind | str,
    device: DeviceSpec | str,
    *,
    precision: Precision | str = Precision.FP32,
) -> float:
    """Seconds of one optimizer step over ``trainable_bytes`` of parameters (in their own dtype,
    fp32: the master weights; a sharded stage passes its shard): memory-bound, so the bytes it
    moves over the device's memory bandwidth. Per parameter element it reads the parameter and
    its gradient and writes the parameter, and reads and writes each state: plain SGD moves 3
    tensors' worth, SGD with momentum 5, Adam 7; under bf16 it also writes the bf16 copy the next
    step computes with (half a tensor more)."""
    optimizer = OptimizerKind.parse(optimizer)
    device = resolve_device(device)
    tensors = 3 + 2 * optimizer.states_per_parameter + (0.5 if Precision.parse(precision) is Precision.BF16 else 0)
    return tensors * trainable_bytes / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)

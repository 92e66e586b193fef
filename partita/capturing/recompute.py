"""Which outputs selective recomputation keeps: one op policy for the cost model and the runtime.

Selective recomputation (``Recompute.SELECTIVE``; Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022) keeps the outputs of the operations that are
expensive to run again and cheap to keep -- the weight matmuls, convolutions and fused attention
kernels -- and recomputes the rest in backward: softmax and its dropout, norms, activation
functions, elementwise arithmetic, and the batched matmuls of eager attention (``Q Kᵀ``, whose
``(B, heads, T, T)`` output is the largest tensor of a layer and takes few FLOPs per byte).

The runtime applies the policy to the aten ops it *dispatches*: ``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts`` (``partita.runtime.pipeline``) asks ``keeps_dispatched``
about every op below autograd, where composite ops have been decomposed: ``linear`` and a
``matmul`` with a weight run as ``mm`` / ``addmm``, a ``matmul`` of two batched activations as
``bmm``, ``conv2d`` as ``convolution``, ``scaled_dot_product_attention`` as one fused kernel
(``_scaled_dot_product_flash_attention_for_cpu`` on the CPU). The cost model sees the captured
graph's nodes, before that decomposition: ``keeps_node`` names the nodes whose dispatched op the
policy keeps, by the same rule. Both are defined here, side by side, so that they cannot drift.

Under sequence parallelism the runtime runs each row-parallel matmul and its reduce-scatter as one
op (``matmul_reduce_scatter``, ``partita.runtime.tensor_parallel_ops``), which the policy keeps:
its output is the device's tokens of the sum, not the whole partial product, and the
recomputation does not run the collective again; so it keeps a column-parallel matmul run with
its input's all-gather (``all_gather_matmul``), whose all-gather is not run again either. On the captured graph that is
the row-parallel matmul node itself (kept by ``keeps_node``); ``partita.cost.tensor_parallel``
counts its kept bytes as the token part.

Known difference: a fused attention that falls back to torch's math path (on devices or inputs
no fused kernel takes) dispatches its parts (``bmm``, ``softmax``) and is recomputed, while the
cost model counts its output as kept.
"""

from __future__ import annotations

from partita.types import OpGraph, OpNode

__all__ = ["KEPT_DISPATCHED_OPS", "keeps_dispatched", "keeps_node"]

# aten ops (the overload packet's name) whose outputs selective recomputation keeps, as dispatched.
KEPT_DISPATCHED_OPS = frozenset(
    {
        "mm",
        "addmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "matmul_reduce_scatter",  # partita's row-parallel matmul + reduce-scatter (partita.runtime.tensor_parallel_ops)
        "all_gather_matmul",  # its all-gather + column-parallel matmul
    }
)

# Captured-graph ops that always dispatch to one of KEPT_DISPATCHED_OPS.
_KEPT_NODE_OPS = frozenset(
    {
        "linear",
        "mm",
        "addmm",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "_convolution",
        "scaled_dot_product_attention",
    }
    | KEPT_DISPATCHED_OPS
)


def keeps_dispatched(op_name: str) -> bool:
    """Whether selective recomputation keeps the output of the dispatched aten op ``op_name``
    (``"mm"``, not ``"aten.mm.default"``): the runtime's policy."""
    return op_name in KEPT_DISPATCHED_OPS


def keeps_node(graph: OpGraph, node: OpNode) -> bool:
    """Whether selective recomputation keeps the output of captured node ``node``: its op always
    dispatches to a kept one, or it is a ``matmul`` with a two-dim operand (a weight: torch folds
    the batch dims of the other into one ``mm``; two batched operands run as ``bmm``)."""
    name = _op_name(node.target)
    if name in _KEPT_NODE_OPS:
        return True
    if name != "matmul":
        return False
    ranks = [len(graph.nodes[p].outputs[0].shape) for p in node.inputs if graph.nodes[p].outputs]
    ranks += [len(graph.parameters[p].shape) for p in node.params if p in graph.parameters]
    ranks += [len(graph.inputs[j].tensor.shape) for j in node.graph_inputs if graph.inputs[j].tensor is not None]
    return 2 in ranks


def _op_name(target: str) -> str:
    """ "aten.addmm.default" -> "addmm" (the same reading as ``partita.cost.table.op_name``)."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]

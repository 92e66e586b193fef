"""Run the exported graph once on fake tensors: concrete output values, FLOPs and aliasing per node.

Fake tensors carry shapes and dtypes but no data, so this works for a model built on the
``meta`` device as well as for a real one, and allocates no activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class NodeMeasurement:
    value: Any  # the node's output on fake tensors (concrete shapes at the example batch size)
    flops: int
    bytes_read: int
    is_view: bool  # every tensor output aliases the storage of an input


class _MeasuringInterpreter(torch.fx.Interpreter):
    """An Interpreter that records, for every call_function node, FLOPs, bytes read and aliasing."""

    def __init__(self, gm: torch.fx.GraphModule, counter: FlopCounterMode):
        super().__init__(gm)
        self.counter = counter
        self.measurements: dict[str, NodeMeasurement] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        before = self.counter.get_total_flops()
        operands = [
            x
            for x in pytree.tree_leaves((self.map_nodes_to_values(n.args, n), self.map_nodes_to_values(n.kwargs, n)))
            if isinstance(x, torch.Tensor)
        ]
        value = super().run_node(n)
        self.measurements[n.name] = NodeMeasurement(
            value=value,
            flops=int(self.counter.get_total_flops() - before),
            bytes_read=sum(_nbytes(t) for t in operands),
            is_view=_aliases_operand(value, operands),
        )
        return value


def measure_nodes(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> dict[str, NodeMeasurement]:
    """Interpret ``gm`` on fake copies of ``flat_inputs``; parameters are faked on first use."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    with fake_mode, FlopCounterMode(display=False, custom_mapping=_grouped_mm_formulas(gm)) as counter:
        interpreter = _MeasuringInterpreter(gm, counter)
        interpreter.run(*fake_inputs)
    return interpreter.measurements


def _grouped_mm_formulas(gm: torch.fx.GraphModule) -> dict:
    """FLOP formulas for the grouped matmuls of mixture-of-experts layers, which FlopCounterMode
    does not count: ``aten._grouped_mm`` and operators named ``*grouped_mm*`` such as
    transformers' ``grouped_mm_fallback``, all ``(tokens, K) x (experts, K, N) -> (tokens, N)``
    with every token row multiplied by one expert's matrix: ``2 * tokens * K * N``."""
    packets = {
        getattr(n.target, "_overloadpacket", None)
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function" and "grouped_mm" in str(n.target)
    }
    return {p: _grouped_mm_flops for p in packets if p is not None}


def _grouped_mm_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    if len(input_shape) != 2 or len(weight_shape) != 3:
        return 0  # another layout (e.g. batched 3-D inputs): not guessed
    tokens, k = input_shape
    return 2 * tokens * k * weight_shape[-1]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aliases_operand(value: Any, operands: list[torch.Tensor]) -> bool:
    outputs = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    if not outputs:
        return True  # no new tensor memory (None, SymInt, or a side-effect-only op)
    storages = {StorageWeakRef(t.untyped_storage()) for t in operands}
    return all(StorageWeakRef(t.untyped_storage()) in storages for t in outputs)

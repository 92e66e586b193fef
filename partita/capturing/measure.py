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
            x for x in pytree.tree_leaves((self.map_nodes_to_values(n.args, n), self.map_nodes_to_values(n.kwargs, n)))
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
    with fake_mode, FlopCounterMode(display=False) as counter:
        interpreter = _MeasuringInterpreter(gm, counter)
        interpreter.run(*fake_inputs)
    return interpreter.measurements


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aliases_operand(value: Any, operands: list[torch.Tensor]) -> bool:
    outputs = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    if not outputs:
        return True  # no new tensor memory (None, SymInt, or a side-effect-only op)
    storages = {StorageWeakRef(t.untyped_storage()) for t in operands}
    return all(StorageWeakRef(t.untyped_storage()) in storages for t in outputs)
